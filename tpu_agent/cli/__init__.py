"""The command line: one module per command, each with a `register(app)`; shared options and formatters.

The typer app with every command is `tpu_agent.cli.app.app`, built on first use: `tpu-agent CMD ...` builds an
app with CMD alone and imports no other command's module."""

from tpu_agent.cli.app import main, run_cli

__all__ = ["main", "run_cli"]
