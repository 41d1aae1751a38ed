"""`tpu-agent doctor`: the environment, as every profile records it."""

from __future__ import annotations

import json
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



def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _show_check(report) -> None:
    """One table per device: each check's result, its first run (compiles) and a warm run, in ms."""
    from rich.table import Table

    console = stdout_console()
    header = report.header
    if header:
        console.print(Text.assemble(("device check", "bold"), f"  {len(header['local_devices'])} local "
                                    f"{header['platform']} device(s) ({header['device_kind']}), process "
                                    f"{header['process_index']} of {header['process_count']}; timings measured "
                                    "here, on this host"))
    devices = list(dict.fromkeys(row["device"] for row in report.rows))
    for device in devices:
        table = Table(title=device, title_justify="left", show_edge=False)
        for name, justify in (("check", "left"), ("result", "left"), ("first ms", "right"), ("warm ms", "right"),
                              ("", "left")):
            table.add_column(name, justify=justify)
        for row in report.rows:
            if row["device"] == device:
                result = Text("pass", style="green") if row["ok"] else Text("FAIL", style="red")
                table.add_row(row["check"], result, _ms(row["first_ms"]), _ms(row["warm_ms"]), row["detail"])
        console.print(table)


def doctor(
    json_output: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    calibrate: Annotated[bool, typer.Option("--calibrate", help="Measure the CPU/GPU peak FLOP/s now (a few seconds) and cache it.")] = False,
    check: Annotated[bool, typer.Option("--check", help="Exercise the tpu device on every local device JAX sees "
                                        "(eager op, fused and compiled steps, copies both ways, all-reduces), "
                                        "each result checked against the CPU and timed; exit 1 on any failure.")] = False,
    devices: Annotated[int | None, typer.Option("--devices", min=1, help="With --check on a CPU host: simulate N "
                                                "devices (TPU_AGENT_DEVICES).")] = None,
) -> int:
    """Report the environment: versions, JAX devices, TorchTPU, API key (yes/no), directories, peak FLOP/s.
    With --check, also prove the device works on this host's chips: the first command on a new TPU VM."""
    from tpu_agent.run.environment import collect_environment

    env = collect_environment(calibrate=calibrate)
    if json_output and not check:
        sys.stdout.write(env.model_dump_json(indent=2) + "\n")
        return 1 if env.problems else 0
    if not json_output:
        _show_environment(env)
    if not check:
        return 1 if env.problems else 0
    from tpu_agent.run.device_check import run

    report = run(devices)
    if json_output:
        payload = {"environment": env.model_dump(mode="json"), "check": {"header": report.header,
                                                                        "rows": report.rows,
                                                                        "failures": report.failures}}
        sys.stdout.write(json.dumps(payload, indent=2) + "\n")
    else:
        _show_check(report)
    for failure in report.failures:
        print(f"error: {failure}", file=sys.stderr)
    if not report.failures and not json_output:
        stdout_console().print(Text(f"all {len(report.rows)} checks passed", style="green"))
    return 1 if report.failures or env.problems else 0



def register(app: typer.Typer) -> None:
    app.command("doctor")(doctor)
