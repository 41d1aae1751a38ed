"""The command line: one module per command, each with a `register(app)`; shared options and formatters."""

from tpu_agent.cli.app import app, main, run_cli

__all__ = ["app", "main", "run_cli"]
