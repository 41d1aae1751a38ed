"""`tpu-agent tune`: options resolved once (flags over [tool.tpu-agent] over defaults), then the pipeline."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from tpu_agent.cli.inputs import check_script
from tpu_agent.cli.options import DeviceMapOption, ScriptArg, ScriptArgs, device_map_env, stderr_console, stdout_console
from tpu_agent.paths import shown_path
from tpu_agent.report.effects import effect_lines


def tune(
    script: ScriptArg,
    script_args: ScriptArgs = None,
    trials: Annotated[int | None, typer.Option(help="Trials (measured configurations). [default: 20]")] = None,
    timeout: Annotated[float | None, typer.Option(help="Stop starting trials after this many seconds.")] = None,
    trial_timeout: Annotated[float | None, typer.Option(help="A trial step running longer is recorded as failed. [default: 600]")] = None,
    steps: Annotated[int | None, typer.Option(help="Interleaved baseline/candidate pairs per trial (>= 5); every measured process runs this length. [default: 20]")] = None,
    warmup: Annotated[int | None, typer.Option(help="Steps each process runs before timing (compilation, >= 1). [default: 2]")] = None,
    pairs: Annotated[int | None, typer.Option(help="Pairs a verification or an ablation measures (>= 5), in rounds of --steps pairs in fresh processes. [default: 20]")] = None,
    verify: Annotated[int | None, typer.Option(help="How many of the best plans to verify in fresh processes (0: search only, nothing verified). [default: 3]")] = None,
    target: Annotated[str | None, typer.Option(help="cpu | v4 | v5e | v5p | v6e | v7x. [default: cpu]")] = None,
    objective: Annotated[str | None, typer.Option(help="time | memory | both. [default: time]")] = None,
    devices: Annotated[int | None, typer.Option(help="Simulated devices on a CPU host (for sharding). [default: 1]")] = None,
    seed: Annotated[int | None, typer.Option(help="Seed of the sampler and the bootstrap. [default: 0]")] = None,
    study: Annotated[str | None, typer.Option(help="Optuna study name (default: from the script and settings).")] = None,
    storage: Annotated[str | None, typer.Option(help="Optuna storage URL (default: SQLite under .tpu-agent/).")] = None,
    resume: Annotated[bool | None, typer.Option("--resume", help="Continue the study; finished trials are not repeated.")] = None,
    min_gain: Annotated[float | None, typer.Option(help="Keep a speedup only if its CI's lower end exceeds 1 + this. [default: 0.03]")] = None,
    loss_tol: Annotated[float | None, typer.Option(help="A shape-changing plan may end with a loss this much worse. [default: 0.02]")] = None,
    candidates: Annotated[int | None, typer.Option(help="Top candidates that span the search space. [default: 6]")] = None,
    allow: Annotated[str | None, typer.Option("--allow", metavar="CLASSES", help="Also search these classes of change (comma-separated): model (architecture: widths, vocabulary rows), training (batch size, sequence length). The data is never changed. [default: exact and numerics only]")] = None,
    proposer: Annotated[str | None, typer.Option(help="auto | offline | claude (auto: claude when ANTHROPIC_API_KEY is set).")] = None,
    offline: Annotated[bool, typer.Option("--offline", help="Use the offline proposer even with an API key.")] = False,
    model: Annotated[str | None, typer.Option(help="Claude model for --proposer claude.")] = None,
    rounds: Annotated[int | None, typer.Option(help="Propose-search rounds; Claude sees the results of earlier rounds. [default: 1]")] = None,
    token_budget: Annotated[int | None, typer.Option(help="Claude tokens for the whole tune. [default: 200000]")] = None,
    playbooks: Annotated[list[str] | None, typer.Option("--playbooks", metavar="DIR", help="Extra playbook directories.")] = None,
    output_dir: Annotated[str | None, typer.Option("--output-dir", "-o", metavar="DIR", help="Where run directories go (default ./.tpu-agent/runs).")] = None,
    apply: Annotated[bool | None, typer.Option("--apply", help="Write the verified source change into your files (backup kept).")] = None,
    force: Annotated[bool | None, typer.Option("--force", help="With --apply: overwrite files with uncommitted changes.")] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
    device_map: DeviceMapOption = None,
) -> int:
    """Find, verify and report changes that make SCRIPT faster on the target device.

    Profiles the script, proposes changes (padding, fused or compiled execution, sharding, precision),
    searches their combinations with Optuna, and keeps only changes whose gain was verified (interleaved
    A/B, bootstrap CI) and whose numerics were checked. Writes report.md, report.json, patch.diff and
    plan.json to the run directory; your files change only with --apply.
    Example: [bold]tpu-agent tune train.py --trials 20 -- --epochs 1[/bold]
    """
    from tpu_agent import pipeline
    from tpu_agent.config import resolve
    from tpu_agent.plan.patch import apply_patch
    from tpu_agent.propose import choose_proposer
    from tpu_agent.search.study import dashboard_command

    check_script(script)
    mapped = device_map_env(device_map)
    flags = dict(trials=trials, timeout=timeout, trial_timeout=trial_timeout, steps=steps, warmup=warmup, pairs=pairs, verify=verify,
                 target=target, objective=objective, devices=devices, seed=seed, study=study, storage=storage,
                 resume=resume, min_gain=min_gain, loss_tol=loss_tol, candidates=candidates, apply=apply, force=force,
                 playbooks=playbooks or None, output_dir=output_dir, proposer=proposer, model=model, rounds=rounds,
                 token_budget=token_budget, allow=allow)
    opts = resolve(script, flags).options
    chosen, why = choose_proposer(opts.proposer, offline)
    check_before_the_baseline(Path(script), opts, chosen)
    console = stderr_console() if json_output else stdout_console()
    os.environ.update(mapped)  # every child of this tune (baseline, trials, verification) inherits the map
    try:
        result, files = pipeline.tune(Path(script), script_args or [], opts, console=console, proposer=chosen,
                                      proposer_why=why)
    finally:
        for name in mapped:
            os.environ.pop(name, None)
    if json_output:
        print(json.dumps({"result": json.loads(result.model_dump_json()),
                          "files": {k: str(v) for k, v in files.items()}}, indent=2))
    else:
        console.print()
        best = result.best
        if best is not None:
            console.print(f"[green bold]verified[/green bold] ({' + '.join(best.plan.effects())}): "
                          f"{escape(best.plan.describe())}")
            for line in effect_lines(best.plan, result.parameters):
                console.print(f"  {line}", markup=False)
            console.print(f"  {best.reason}")
        elif result.interrupted:
            console.print("[yellow bold]interrupted[/yellow bold]: no change verified; what finished is in the "
                          "study, --resume continues")
        else:
            console.print("[bold]no change verified[/bold]: the baseline stays")
        for name in ("report.md", "patch.diff", "plan.json"):
            if name in files:
                console.print(f"  {name}: {shown_path(files[name])}")
        console.print(f"  study {result.study!r}: {dashboard_command(result.storage)}", markup=False)
    if opts.apply and result.best is not None:
        if "patch.diff" in files:
            apply_patch(result.best.plan, Path(script), force=opts.force, say=console.print)
        else:
            console.print("--apply: the verified plan has no source edits, nothing was written; "
                          + "; ".join(a.instruction() or a.describe() for a in result.best.plan.actions)
                          + "; `tpu-agent run SCRIPT --plan plan.json` applies them all", markup=False)
    return 130 if result.interrupted else 0


def check_before_the_baseline(script: Path, opts, proposer: str) -> None:
    """What would fail after minutes of measuring fails now, one line each (exit 2)."""
    from tpu_agent import envvars
    from tpu_agent.errors import InputError
    from tpu_agent.plan.patch import uncommitted_sources
    from tpu_agent.propose.playbook import PlaybookError, load_playbooks

    for directory in opts.playbooks:
        if not Path(directory).is_dir():
            raise InputError(f"--playbooks {directory}: no such directory")
    try:
        load_playbooks(opts.playbooks)
    except PlaybookError as exc:
        raise InputError(f"--playbooks: {exc}") from None
    if opts.apply and not opts.force:
        dirty = uncommitted_sources(script)
        if dirty:
            raise InputError(f"--apply: {', '.join(dirty[:5])} {'has' if len(dirty) == 1 else 'have'} uncommitted "
                             "changes; commit them or pass --force")
    if proposer == "claude" and not envvars.ANTHROPIC_API_KEY.get():
        raise InputError("--proposer claude needs ANTHROPIC_API_KEY in the environment "
                         "(or use --proposer offline)")


def register(app: typer.Typer) -> None:
    app.command("tune")(tune)
