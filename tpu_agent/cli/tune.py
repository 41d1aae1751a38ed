"""`tpu-agent tune` and `tpu-agent run --plan`: the command-line side of tuning."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError
from rich.console import Console

from tpu_agent.errors import InputError
from tpu_agent.cli.inputs import check_script
from tpu_agent.paths import RUNS_SUBDIR
from tpu_agent.plan.actions import PadDim, Plan

PLAN_ENV = "TPU_AGENT_PLAN"


def load_plan(path: str) -> Plan:
    """A plan file, or one clear line: pydantic's first complaint with its location."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise InputError(f"cannot read plan {path}: {exc.strerror or exc}") from None
    try:
        return Plan.model_validate_json(text)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "plan"
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise InputError(f"invalid plan {path}: {where}: {first.get('msg')}{more}") from None


def run_with_plan(script: str, args: list[str], plan_path: str) -> tuple[str, dict[str, str]]:
    """The script to run (a rewritten copy when the plan edits source) and the environment for the child."""
    from tpu_agent.paths import new_run_dir
    from tpu_agent.plan.rewrite import apply_pad_dims

    plan = load_plan(plan_path)
    env = dict(os.environ)
    env[PLAN_ENV] = plan.model_dump_json()
    if not plan.of(PadDim):
        return script, env
    workspace = new_run_dir(Path(script), Path.cwd() / RUNS_SUBDIR) / "workspace"
    rewrite = apply_pad_dims(plan, Path(script), workspace)  # SourceChanged: exit 2, one line
    return str(rewrite.script), env


def tune_command(script: str, args: list[str], settings, *, proposer: str, model: str | None, apply: bool,
                 force: bool, json_output: bool, console: Console) -> int:
    from tpu_agent.report import markdown as report
    from tpu_agent.search import tune

    check_script(script)
    runs_root = Path.cwd() / RUNS_SUBDIR
    runs_root.mkdir(parents=True, exist_ok=True)
    result = tune.run(Path(script), args, settings, console=console, proposer=proposer, runs_root=runs_root,
                      model=model)
    files = report.write_all(result, Path(script))
    run_dir = Path(result.run_dir)
    if json_output:
        print(json.dumps({"result": json.loads(result.model_dump_json()),
                          "files": {k: str(v) for k, v in files.items()}}, indent=2))
    else:
        console.print()
        best = result.best
        if best is not None:
            console.print(f"[green bold]verified[/green bold]: {tune._plan_text(best.plan)}")
            console.print(f"  {best.reason}")
        else:
            console.print("[bold]no change verified[/bold]: the baseline stays")
        for name in ("report.md", "patch.diff", "plan.json"):
            if name in files:
                console.print(f"  {name}: {_rel(files[name])}")
    if apply and result.best is not None and "patch.diff" in files:
        apply_patch(files["patch.diff"], result.best.plan, Path(script), force=force, console=console)
    if result.interrupted:
        return 130
    return 0


def _rel(path: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def apply_patch(patch: Path, plan: Plan, script: Path, *, force: bool, console: Console) -> None:
    """Write the verified source change into the user's files: refuses over uncommitted edits, keeps backups."""
    from tpu_agent.plan.rewrite import planned_changes

    script_dir = script.resolve().parent
    changes = planned_changes(plan, script_dir)
    for change in changes:
        target = script_dir / change.path
        if not force and _uncommitted(target):
            raise InputError(f"{_rel(target)} has uncommitted changes; commit them or pass --force")
    backups = Path.cwd() / RUNS_SUBDIR.parent / "backups"
    backups.mkdir(parents=True, exist_ok=True)
    for change in changes:
        target = script_dir / change.path
        backup = backups / f"{target.name}.{os.getpid()}.orig"
        shutil.copy2(target, backup)
        target.write_bytes(change.after)
        console.print(f"applied to {_rel(target)} (backup: {_rel(backup)})")


def _uncommitted(path: Path) -> bool:
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--", path.name], cwd=path.parent,
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    if out.returncode != 0:
        return False  # not a git work tree: nothing to lose track of, a backup is kept
    return bool(out.stdout.strip())


def raise_for_bad_settings(exc: ValidationError) -> None:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first.get("loc", ()))
    raise InputError(f"invalid option {where}: {first.get('msg')}") from None



def register(app) -> None:
    """Adds `tune` to the CLI."""

    @app.command()
    def tune(
        script: Annotated[str, typer.Argument(metavar="SCRIPT", help="The training script.", show_default=False)],
        script_args: Annotated[list[str] | None, typer.Argument(metavar="ARGS", help="Arguments for the script, after `--`.",
                                                                  show_default=False)] = None,
        trials: Annotated[int | None, typer.Option(help="Trials (measured configurations). [default: 20]")] = None,
        timeout: Annotated[float | None, typer.Option(help="Stop starting trials after this many seconds.")] = None,
        steps: Annotated[int | None, typer.Option(help="Interleaved baseline/candidate pairs per trial. [default: 10]")] = None,
        warmup: Annotated[int | None, typer.Option(help="Steps each process runs before timing (compilation). [default: 2]")] = None,
        pairs: Annotated[int | None, typer.Option(help="Pairs when verifying the winner (>= 5). [default: 5]")] = None,
        target: Annotated[str | None, typer.Option(help="cpu | v4 | v5e | v5p | v6e | v7x. [default: cpu]")] = None,
        objective: Annotated[str | None, typer.Option(help="time | memory | both. [default: time]")] = None,
        devices: Annotated[int | None, typer.Option(help="Simulated devices on a CPU host (for sharding). [default: 1]")] = None,
        seed: Annotated[int | None, typer.Option(help="Seed of the sampler and the bootstrap. [default: 0]")] = None,
        study: Annotated[str | None, typer.Option(help="Optuna study name (default: from the script and settings).")] = None,
        storage: Annotated[str | None, typer.Option(help="Optuna storage URL (default: SQLite under .tpu-agent/).")] = None,
        resume: Annotated[bool | None, typer.Option("--resume", help="Continue the study; finished trials are not repeated.")] = None,
        min_gain: Annotated[float | None, typer.Option(help="Keep a speedup only if its CI's lower end exceeds 1 + this. [default: 0.03]")] = None,
        loss_tol: Annotated[float | None, typer.Option(help="A shape-changing plan may end with a loss this much worse. [default: 0.02]")] = None,
        proposer: Annotated[str | None, typer.Option(help="auto | offline | claude (auto: claude when ANTHROPIC_API_KEY is set).")] = None,
        offline: Annotated[bool, typer.Option("--offline", help="Use the offline proposer even with an API key.")] = False,
        model: Annotated[str | None, typer.Option(help="Claude model for --proposer claude.")] = None,
        rounds: Annotated[int | None, typer.Option(help="Propose-search rounds; Claude sees the results of earlier rounds. [default: 1]")] = None,
        token_budget: Annotated[int | None, typer.Option(help="Claude tokens for the whole tune. [default: 200000]")] = None,
        playbooks: Annotated[list[str] | None, typer.Option("--playbooks", metavar="DIR", help="Extra playbook directories.")] = None,
        apply: Annotated[bool | None, typer.Option("--apply", help="Write the verified source change into your files (backup kept).")] = None,
        force: Annotated[bool | None, typer.Option("--force", help="With --apply: overwrite files with uncommitted changes.")] = None,
        json_output: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
    ) -> int:
        """Find, verify and report changes that make SCRIPT faster on the target device.

        Profiles the script, proposes changes (padding, fused or compiled execution, sharding, precision),
        searches their combinations with Optuna, and keeps only changes whose gain was verified (interleaved
        A/B, bootstrap CI) and whose numerics were checked. Writes report.md, report.json, patch.diff and
        plan.json to the run directory; your files change only with --apply.
        Example: [bold]tpu-agent tune train.py --trials 20 -- --epochs 1[/bold]
        """
        from tpu_agent.config import resolve
        from tpu_agent.search.tune import TuneSettings

        check_script(script)
        flags = dict(trials=trials, timeout=timeout, steps=steps, warmup=warmup, pairs=pairs, target=target,
                     objective=objective, devices=devices, seed=seed, study=study, storage=storage, resume=resume,
                     min_gain=min_gain, loss_tol=loss_tol, apply=apply, force=force, playbooks=playbooks or None,
                     proposer=proposer, model=model, rounds=rounds, token_budget=token_budget)
        opts = resolve(script, flags).options
        settings = TuneSettings(
            trials=opts.trials, timeout=opts.timeout, steps=max(opts.steps, 5), warmup=max(opts.warmup, 1),
            pairs=opts.pairs, target=opts.target, objective=opts.objective, seed=opts.seed, study=opts.study,
            storage=opts.storage, resume=opts.resume, min_gain=opts.min_gain, loss_tol=opts.loss_tol,
            step_timeout=opts.trial_timeout, devices=opts.devices if opts.devices > 1 else None,
            playbooks=list(opts.playbooks), rounds=opts.rounds, token_budget=opts.token_budget,
        )
        from tpu_agent.propose import choose_proposer

        chosen, why = choose_proposer(opts.proposer, offline)
        console = Console(stderr=json_output)
        console.print(f"proposer: {chosen} ({why})")
        return tune_command(script, script_args or [], settings, proposer=chosen, model=opts.model, apply=opts.apply,
                            force=opts.force, json_output=json_output, console=console)
