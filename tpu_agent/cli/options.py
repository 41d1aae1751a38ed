"""Arguments and options more than one command takes, declared once."""

from __future__ import annotations

from typing import Annotated

import typer

ScriptArg = Annotated[str, typer.Argument(metavar="SCRIPT", help="The training script, as you would pass it to python.",
                                          show_default=False)]
ScriptArgs = Annotated[list[str] | None, typer.Argument(
    metavar="ARGS", help="Arguments for the script; put `--` before them.", show_default=False)]
DeviceMapOption = Annotated[str | None, typer.Option(
    "--device-map", metavar="FROM=TO", show_default=False,
    help="Run a script written for another device on tpu, unedited: cuda=tpu maps torch.cuda, .cuda(), "
         ".to(\"cuda\"), device=\"cuda\" and CUDA autocast/GradScaler to tpu for this run.")]
JsonOutput = Annotated[bool, typer.Option("--json", help="Print the result as JSON.")]

PROG = "tpu-agent"
NPROC_WITH_DEVICES = ("--devices simulates devices in one process; with --nproc each rank is one process with one "
                      "device: give one or the other")  # profile's and tune's one line (exit 2)


def device_map_env(text: str | None) -> dict[str, str]:
    """The child's environment entry for --device-map, checked first (one line, exit 2, when unsupported)."""
    if text is None:
        return {}
    from tpu_agent import envvars
    from tpu_agent.run.device_map import parse

    return {envvars.DEVICE_MAP.name: parse(text).spelled()}


def stdout_console():
    from rich.console import Console

    return Console(soft_wrap=True, highlight=False)


def stderr_console():
    from rich.console import Console

    return Console(stderr=True, soft_wrap=True, highlight=False)
