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


def help_text(help: str, default: object, shown: str | None = None) -> str:
    """An option's help as every command prints it: the declared text, then `[default: ...]` where a default is
    worth showing (`shown`: one better said in words), escaped for rich."""
    from rich.markup import escape

    if shown is None and default is not None and default is not False and default != []:
        shown = f"{default:g}" if isinstance(default, float) else str(default)
    return escape(help + (f" [default: {shown}]" if shown else ""))


def declared_option(name: str, *, bounds: bool = True):
    """The typer option of a shared option (config.SHARED: --nproc, --warmup, --target, --output-dir), as every
    command that takes it declares it. `bounds`: click checks the lower bound (tune leaves it to pydantic, which
    checks [tool.tpu-agent] the same way)."""
    from tpu_agent.config import SHARED

    d = SHARED[name]
    names = [f"--{name.replace('_', '-')}", *([d.short] if d.short else [])]
    limits = {"min": d.ge} if bounds and d.ge is not None else {}
    return typer.Option(*names, metavar=d.metavar, help=help_text(d.help, d.default), show_default=False, **limits)


NprocOption = Annotated[int | None, declared_option("nproc")]

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
