"""The `tpu-agent` command line.

Commands raise `TpuAgentError`/`InputError` or return an exit code; `main()`
alone turns failures into one `error: ...` line on stderr, so every command,
present and future, fails the same way (exit 1 job failed, 2 bad usage/input).
"""

from __future__ import annotations

import enum
import os
import sys
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from rich.text import Text

try:  # typer >= 0.2x vendors click
    from typer._click import exceptions as click_exceptions
except ImportError:  # pragma: no cover - older typer on real click
    from click import exceptions as click_exceptions

from tpu_agent import __version__
from tpu_agent.run.environment import Environment, collect_environment
from tpu_agent.errors import TpuAgentError
from tpu_agent.cli.inputs import check_script

PROG = "tpu-agent"

app = typer.Typer(
    name=PROG,
    help="Run, profile and tune PyTorch training scripts on a `tpu` device.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
)

stdout = Console(soft_wrap=True, highlight=False)
stderr = Console(stderr=True, soft_wrap=True, highlight=False)


def _version_callback(value: bool) -> None:
    if value:
        print(f"{PROG} {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version_callback, is_eager=True, help="Print the version and exit."),
    ] = False,
) -> None:
    """Run, profile and tune PyTorch training scripts on a `tpu` device."""


# ---------------------------------------------------------------- doctor


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
    for key, value in rows:
        stdout.print(Text.assemble((f"{key:<{width}}", "bold"), "  ", value))
    for problem in env.problems:
        stdout.print(Text.assemble(("problem: ", "red"), problem))


@app.command()
def doctor(
    json_output: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    calibrate: Annotated[bool, typer.Option("--calibrate", help="Measure the CPU/GPU peak FLOP/s now (a few seconds) and cache it.")] = False,
) -> int:
    """Report the environment: versions, JAX devices, TorchTPU, API key (yes/no), directories, peak FLOP/s."""
    env = collect_environment(calibrate=calibrate)
    if json_output:
        sys.stdout.write(env.model_dump_json(indent=2) + "\n")
    else:
        _show_environment(env)
    return 1 if env.problems else 0


# ---------------------------------------------------------------- run

ScriptArg = Annotated[str, typer.Argument(metavar="SCRIPT", help="The training script, as you would pass it to python.",
                                          show_default=False)]
ScriptArgs = Annotated[list[str] | None, typer.Argument(
    metavar="ARGS", help="Arguments for the script; put `--` before them.", show_default=False)]


@app.command()
def run(
    script: ScriptArg,
    script_args: ScriptArgs = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No summary line after the run.")] = False,
    plan: Annotated[str | None, typer.Option("--plan", metavar="PLAN.json", help="Run with a plan: source edits on a copy, run-time actions in the backend.", show_default=False)] = None,
) -> int:
    """Run SCRIPT with the bundled `tpu` device loaded, as `python SCRIPT ARGS...` would.

    Same argv, working directory and sys.path[0]; the exit code is the script's own.
    Example: [bold]tpu-agent run train.py -- --epochs 1[/bold]
    """
    from tpu_agent.run.launch import run_script  # keeps `--help` and `doctor` lean

    check_script(script)
    env = None
    if plan is not None:
        from tpu_agent.cli.tune import run_with_plan

        script, env = run_with_plan(script, script_args or [], plan)
    try:
        result = run_script(script, script_args or [], env=env)  # as typed, like `python SCRIPT`
    except OSError as exc:
        raise TpuAgentError(f"could not start the run: {exc}") from None
    if not quiet:
        run_dir = Path(result.run_dir)
        try:
            run_dir = run_dir.relative_to(Path.cwd())
        except ValueError:
            pass
        status = "[green]exit 0[/green]" if result.ok else f"[red]exit {result.exit_code}[/red]"
        stderr.print(f"[dim]{PROG}:[/dim] {escape(script)} {status} after {result.duration_s:.2f} s; run recorded in {escape(str(run_dir))}")
    return result.exit_code


# ---------------------------------------------------------------- profile


class ProfileMode(str, enum.Enum):
    eager = "eager"
    fused = "fused"
    compiled = "compiled-if-available"


class TargetGeneration(str, enum.Enum):
    v4 = "v4"
    v5e = "v5e"
    v5p = "v5p"
    v6e = "v6e"
    v7x = "v7x"


@app.command()
def profile(
    script: ScriptArg,
    script_args: ScriptArgs = None,
    steps: Annotated[
        int | None,
        typer.Option("--steps", min=1, help="Stop the script cleanly after N measured steps (after warm-up). Default: run it to the end.", show_default=False),
    ] = None,
    warmup: Annotated[int, typer.Option("--warmup", min=0, help="First K steps (compilation) left out of the statistics.")] = 2,
    mode: Annotated[ProfileMode, typer.Option("--mode", help="How the device runs ops: op by op, fused into one program per step, or compiled where the backend can.")] = ProfileMode.fused,
    devices: Annotated[int, typer.Option("--devices", min=1, help="Simulate N devices on the CPU.")] = 1,
    target: Annotated[
        TargetGeneration | None,
        typer.Option("--target", help="TPU generation for a roofline estimate (and the padding report).", show_default=False),
    ] = None,
    dump_hlo: Annotated[bool, typer.Option("--dump-hlo/--no-dump-hlo", help="Write the optimized HLO of every executable that ran to the run directory.")] = True,
    xla_dump: Annotated[bool, typer.Option("--xla-dump", help="Also turn on XLA's own dump (--xla_dump_to) into the run directory.")] = False,
    trace: Annotated[
        Path | None,
        typer.Option("--trace", metavar="DIR", help="Record a jax.profiler trace of the measured steps (TensorBoard/XProf, Perfetto).", show_default=False),
    ] = None,
    time_executables: Annotated[bool, typer.Option("--time-executables", help="Wait for every executable so its recorded time is execution time (slower).")] = False,
    output_dir: Annotated[
        Path | None,
        typer.Option("--output-dir", "-o", metavar="DIR", help="Where run directories go (default ./.tpu-agent/runs).", show_default=False),
    ] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print profile.json to stdout (the script's output goes to stderr).")] = False,
) -> int:
    """Profile SCRIPT on the bundled `tpu` device: step time, FLOPs, MFU, memory, hot ops, padding waste.

    Steps are found without changing the script (every optimizer step, or
    torch.tpu.mark_step()). Writes profile.json, HLO files and a step-time plot
    to .tpu-agent/runs/<time>-<script>/. The exit code is the script's own.
    Example: [bold]tpu-agent profile train.py --steps 10 -- --epochs 1[/bold]
    """
    from tpu_agent.cli.profile import profile as run_profile
    from tpu_agent.profilers.schema import Settings

    settings = Settings(
        steps=steps, warmup=warmup, mode=mode.value, devices=devices, target=target.value if target else None,
        dump_hlo=dump_hlo, xla_dump=xla_dump, trace_dir=str(trace) if trace else None,
        time_executables=time_executables,
    )
    return run_profile(script, script_args or [], settings=settings, output_dir=output_dir,
                       json_output=json_output, stdout=stdout, stderr=stderr)


# ---------------------------------------------------------------- playbooks

from tpu_agent.cli.playbooks import app as _playbooks_app  # noqa: E402  (light: loads playbooks per command)

app.add_typer(_playbooks_app, name="playbooks")

from tpu_agent.cli import diff as cmd_diff
from tpu_agent.cli import knobs as cmd_knobs  # noqa: E402  (light: libcst and profiles load per command)

cmd_knobs.register(app)
cmd_diff.register(app)

from tpu_agent.cli import tune as cmd_tune  # noqa: E402  (light: optuna and the backend load per command)

cmd_tune.register(app)


# ---------------------------------------------------------------- entry


def _usage_line(exc: click_exceptions.UsageError) -> str:
    ctx = exc.ctx
    where = ctx.command_path if ctx is not None else PROG
    if isinstance(exc, click_exceptions.NoSuchOption):
        message = f"no such option: {exc.option_name}"
        takes_script_args = ctx is not None and any(p.name == "script_args" for p in ctx.command.params)
        if takes_script_args:
            return f"{message} (arguments for the script go after '--': {where} SCRIPT -- {exc.option_name} ...)"
        if exc.possibilities:
            message += f"; did you mean {' or '.join(sorted(exc.possibilities))}?"
        return f"{message} (see '{where} --help')"
    message = " ".join(exc.format_message().split()).rstrip(".")
    if message[:2].istitle():  # "Missing argument" -> "missing argument", leave "SCRIPT" alone
        message = message[0].lower() + message[1:]
    return f"{message} (see '{where} --help')"


def _error(message: str) -> None:
    sys.stdout.flush()
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()


def run_cli(argv: list[str] | None = None) -> int:
    """Run the app and return the exit code instead of exiting."""
    command = typer.main.get_command(app)
    args = sys.argv[1:] if argv is None else argv
    try:
        rv = command.main(args=args, prog_name=PROG, standalone_mode=False)
    except click_exceptions.NoArgsIsHelpError as exc:
        # Bare `tpu-agent` asks for help. With rich the help is already printed
        # while the exception is built; without it, it is the message.
        if exc.format_message().strip():
            print(exc.format_message())
        return 0
    except click_exceptions.UsageError as exc:
        _error(_usage_line(exc))
        return 2
    except click_exceptions.ClickException as exc:
        _error(" ".join(exc.format_message().split()))
        return exc.exit_code
    except typer.Abort:
        _error("aborted")
        return 1
    except TpuAgentError as exc:
        _error(str(exc))
        return exc.exit_code
    return rv if isinstance(rv, int) else 0


def main() -> NoReturn:
    code = run_cli()
    try:
        sys.stdout.flush()
    except BrokenPipeError:  # `tpu-agent doctor | head -1`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = code or 1
    sys.exit(code)
