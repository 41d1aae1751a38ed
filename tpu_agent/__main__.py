"""`python -m tpu_agent` is `tpu-agent`."""

from tpu_agent.cli.app import main

main()
