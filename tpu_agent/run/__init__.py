"""Running the user's script: the one child launcher, the child process, the environment it reports."""
