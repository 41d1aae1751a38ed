"""`tpu-agent run SCRIPT [--plan PLAN.json] [-- ARGS]`: the script as `python SCRIPT ARGS` would run it, with our device."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError
from rich.markup import escape

from tpu_agent import envvars
from tpu_agent.cli.inputs import check_script
from tpu_agent.cli.options import (PROG, DeviceMapOption, NprocOption, ScriptArg, ScriptArgs, device_map_env,
                                    stderr_console)
from tpu_agent.errors import InputError, TpuAgentError, validation_line
from tpu_agent.paths import RUNS_SUBDIR, shown_path


def load_plan(path: str):
    """A plan file, or one clear line: pydantic's first complaint with its location."""
    from tpu_agent.plan.actions import Plan

    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise InputError(f"cannot read plan {path}: {exc.strerror or exc}") from None
    from tpu_agent.plan.actions import SCHEMA_VERSION

    try:
        plan = Plan.model_validate_json(text)
    except ValidationError as exc:
        raise InputError(f"invalid plan {path}: {validation_line(exc, where_if_none='plan', more=True)}") from None
    if plan.schema_version > SCHEMA_VERSION:
        raise InputError(f"plan {path} has schema_version {plan.schema_version}, newer than this tpu-agent reads "
                         f"({SCHEMA_VERSION}); upgrade tpu-agent or make the plan again")
    return plan


def run_with_plan(script: str, plan_path: str) -> tuple[str, dict[str, str], Path | None]:
    """The script to run (a rewritten copy when the plan edits source), the environment for the
    child, and the run directory that holds the copy (None: no copy)."""
    from tpu_agent.paths import new_run_dir
    from tpu_agent.plan.actions import PadDim
    from tpu_agent.plan.rewrite import apply_pad_dims

    plan = load_plan(plan_path)
    env = dict(os.environ)
    env[envvars.PLAN.name] = plan.model_dump_json()
    if not plan.of(PadDim):
        return script, env, None
    run_dir = new_run_dir(Path(script), Path.cwd() / RUNS_SUBDIR)
    rewrite = apply_pad_dims(plan, Path(script), run_dir / "workspace")  # SourceChanged: exit 2, one line
    return str(rewrite.script), env, run_dir


def run(
    script: ScriptArg,
    script_args: ScriptArgs = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No summary line after the run.")] = False,
    plan: Annotated[str | None, typer.Option("--plan", metavar="PLAN.json", help="Run with a plan: source edits on a copy, run-time actions in the backend.", show_default=False)] = None,
    device_map: DeviceMapOption = None,
    nproc: NprocOption = None,
) -> int:
    """Run SCRIPT with the bundled `tpu` device loaded, as `python SCRIPT ARGS...` would.

    Same argv, working directory and sys.path[0]; the exit code is the script's own.
    A run whose model trained without touching tpu ends with a warning saying so.
    Example: [bold]tpu-agent run train.py -- --epochs 1[/bold]; a script written for CUDA:
    [bold]tpu-agent run --device-map cuda=tpu train.py[/bold]; a torchrun script on 2 ranks:
    [bold]tpu-agent run --nproc 2 train.py[/bold]
    """
    from tpu_agent.run.launch import run_script  # keeps `--help` and `doctor` lean
    from tpu_agent.run.rendezvous import one_rank

    check_script(script)
    mapped = device_map_env(device_map)
    env, run_dir, ran = None, None, script
    if plan is not None:
        ran, env, run_dir = run_with_plan(script, plan)
    if mapped:
        env = {**(env if env is not None else os.environ), **mapped}
    if nproc == 1:  # a torchrun script at one rank: its init_process_group() finds a group of one
        env = one_rank(dict(env if env is not None else os.environ))
    try:
        result = run_script(ran, script_args or [], env=env, run_dir=run_dir, nproc=nproc or 1)  # as typed, like `python SCRIPT`
    except OSError as exc:
        raise TpuAgentError(f"could not start the run: {exc}") from None
    if not quiet:
        status = "[green]exit 0[/green]" if result.ok else f"[red]exit {result.exit_code}[/red]"
        with_plan = f" with plan {escape(plan)}" if plan is not None else ""
        stderr_console().print(f"[dim]{PROG}:[/dim] {escape(script)}{with_plan} {status} after {result.duration_s:.2f} s; "
                               f"run recorded in {escape(shown_path(result.run_dir))}")
    return result.exit_code


def register(app: typer.Typer) -> None:
    app.command("run")(run)
