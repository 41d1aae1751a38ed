"""`tpu-agent doctor`: the environment, as every profile records it."""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich.text import Text

from tpu_agent.cli.options import stdout_console
from tpu_agent.profilers.schema import Environment



def _flag(flag: bool | None, yes: str = "yes", no: str = "no") -> Text:
    if flag is None:
        return Text("unknown", style="red")
    return Text(yes, style="green") if flag else Text(no, style="yellow")


def _value(value: str | None, missing: str = "missing") -> Text:
    return Text(value) if value else Text(missing, style="red")


def _peak(env: Environment) -> Text:
    if env.peak_flops_per_s is None:
        return Text("not calibrated yet (the first `tpu-agent profile` measures it, or `tpu-agent doctor --calibrate`)",
                    style="yellow")
    return Text(f"{env.peak_flops_per_s / 1e9:,.1f} GFLOP/s  {env.peak_source}")


def _show_environment(env: Environment) -> None:
    devices = ", ".join(f"{d.platform}:{d.id} ({d.device_kind})" for d in env.jax_devices)
    rows = [
        ("tpu-agent", Text(env.tpu_agent_version)),
        ("python", Text(f"{env.python_version}  {env.python_executable}")),
        ("os", Text(f"{env.os}  {env.machine}, {env.cpu_count} CPUs")),
        ("torch", _value(env.torch_version)),
        ("torch 'tpu' device", _flag(env.torch_tpu_device, "registered", "not registered")),
        ("jax", _value(env.jax_version)),
        ("jaxlib", _value(env.jaxlib_version)),
        ("jax platform", _value(env.jax_default_backend, "unavailable")),
        ("jax devices", _value(devices, "none")),
        ("torch_tpu (Google)", _flag(env.torch_tpu_importable, "importable", "not installed")),
        ("ANTHROPIC_API_KEY set", _flag(env.anthropic_api_key_set)),
        ("cache dir", Text(env.cache_dir)),
        ("runs dir", Text(env.runs_dir)),
        ("peak FLOP/s (MFU)", _peak(env)),
    ]
    width = max(len(key) for key, _ in rows)
    console = stdout_console()
    for key, value in rows:
        console.print(Text.assemble((f"{key:<{width}}", "bold"), "  ", value))
    for problem in env.problems:
        console.print(Text.assemble(("problem: ", "red"), problem))



def doctor(
    json_output: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    calibrate: Annotated[bool, typer.Option("--calibrate", help="Measure the CPU/GPU peak FLOP/s now (a few seconds) and cache it.")] = False,
) -> int:
    """Report the environment: versions, JAX devices, TorchTPU, API key (yes/no), directories, peak FLOP/s."""
    from tpu_agent.run.environment import collect_environment

    env = collect_environment(calibrate=calibrate)
    if json_output:
        sys.stdout.write(env.model_dump_json(indent=2) + "\n")
    else:
        _show_environment(env)
    return 1 if env.problems else 0



def register(app: typer.Typer) -> None:
    app.command("doctor")(doctor)
