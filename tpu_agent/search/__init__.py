"""The search: an Optuna study over the candidates' options, each trial a plan timed in warm processes."""
