"""Arguments and options more than one command takes, declared once."""

from __future__ import annotations

from typing import Annotated

import typer

ScriptArg = Annotated[str, typer.Argument(metavar="SCRIPT", help="The training script, as you would pass it to python.",
                                          show_default=False)]
ScriptArgs = Annotated[list[str] | None, typer.Argument(
    metavar="ARGS", help="Arguments for the script; put `--` before them.", show_default=False)]
JsonOutput = Annotated[bool, typer.Option("--json", help="Print the result as JSON.")]

PROG = "tpu-agent"


def stdout_console():
    from rich.console import Console

    return Console(soft_wrap=True, highlight=False)


def stderr_console():
    from rich.console import Console

    return Console(stderr=True, soft_wrap=True, highlight=False)
