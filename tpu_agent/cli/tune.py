"""`tpu-agent tune`: options resolved once (flags over [tool.tpu-agent] over defaults), then the pipeline."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from tpu_agent.cli.inputs import check_script
from tpu_agent.cli.options import (NPROC_WITH_DEVICES, DeviceMapOption, ScriptArg, ScriptArgs, declared_option,
                                    device_map_env, help_text, stderr_console, stdout_console)
from tpu_agent.config import TuneOptions, resolve
from tpu_agent.paths import shown_path
from tpu_agent.report.effects import effect_lines

if TYPE_CHECKING:
    from tpu_agent.propose import ProposerChoice


def flag(name: str):
    """The `--name` option of a TuneOptions field: its help and default as declared there (a shared option's as
    config.SHARED declares it for every command). A flag not given is None, so that [tool.tpu-agent] and then the
    declared default apply (config.resolve)."""
    from tpu_agent.config import SHARED

    if name in SHARED:
        return declared_option(name, bounds=False)
    field = TuneOptions.model_fields[name]
    extra = field.json_schema_extra or {}
    text = help_text(field.description, field.get_default(call_default_factory=True), extra.get("shown"))
    names = [f"--{name.replace('_', '-')}", *([extra["short"]] if "short" in extra else [])]
    return typer.Option(*names, metavar=extra.get("metavar"), help=text)


def tune(
    script: ScriptArg,
    script_args: ScriptArgs = None,
    trials: Annotated[int | None, flag("trials")] = None,
    timeout: Annotated[float | None, flag("timeout")] = None,
    trial_timeout: Annotated[float | None, flag("trial_timeout")] = None,
    steps: Annotated[int | None, flag("steps")] = None,
    warmup: Annotated[int | None, flag("warmup")] = None,
    pairs: Annotated[int | None, flag("pairs")] = None,
    processes: Annotated[int | None, flag("processes")] = None,
    verify: Annotated[int | None, flag("verify")] = None,
    target: Annotated[str | None, flag("target")] = None,
    slices: Annotated[int | None, flag("slices")] = None,
    objective: Annotated[str | None, flag("objective")] = None,
    devices: Annotated[int | None, flag("devices")] = None,
    nproc: Annotated[int | None, flag("nproc")] = None,
    seed: Annotated[int | None, flag("seed")] = None,
    study: Annotated[str | None, flag("study")] = None,
    storage: Annotated[str | None, flag("storage")] = None,
    resume: Annotated[bool | None, flag("resume")] = None,
    workers: Annotated[int | None, flag("workers")] = None,
    join: Annotated[str | None, flag("join")] = None,
    verify_on: Annotated[str | None, flag("verify_on")] = None,
    min_gain: Annotated[float | None, flag("min_gain")] = None,
    loss_tol: Annotated[float | None, flag("loss_tol")] = None,
    candidates: Annotated[int | None, flag("candidates")] = None,
    allow: Annotated[str | None, flag("allow")] = None,
    proposer: Annotated[str | None, flag("proposer")] = None,
    offline: Annotated[bool, typer.Option("--offline", help="Use the offline proposer even with an API key.")] = False,
    model: Annotated[str | None, flag("model")] = None,
    rounds: Annotated[int | None, flag("rounds")] = None,
    token_budget: Annotated[int | None, flag("token_budget")] = None,
    playbooks: Annotated[list[str] | None, flag("playbooks")] = None,
    output_dir: Annotated[str | None, flag("output_dir")] = None,
    apply: Annotated[bool | None, flag("apply")] = None,
    force: Annotated[bool | None, flag("force")] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
    device_map: DeviceMapOption = None,
) -> int:
    """Find, verify and report changes that make SCRIPT faster on the target device.

    Profiles the script, proposes changes (padding, fused or compiled execution, sharding, precision),
    searches their combinations with Optuna, and keeps only changes whose gain was verified (interleaved
    A/B, bootstrap CI) and whose numerics were checked. Writes report.md, report.json, patch.diff and
    plan.json to the run directory; your files change only with --apply.
    Example: [bold]tpu-agent tune train.py --trials 20 -- --epochs 1[/bold];
    [bold]tpu-agent tune --nproc 2 train.py --trials 10[/bold] (a torchrun script, every rank)
    """
    given = {name: value for name, value in locals().items() if name in TuneOptions.model_fields}  # the flags
    from tpu_agent import envvars, interrupts, pipeline
    from tpu_agent.plan.patch import apply_patch
    from tpu_agent.propose import choose_proposer
    from tpu_agent.report.console import TuneLines
    from tpu_agent.search.study import dashboard_command

    check_script(script)
    mapped = device_map_env(device_map)
    flags = {**given, "playbooks": playbooks or None}
    resolved = resolve(script, flags)
    opts = resolved.options
    if opts.nproc == 1 and resolved.sources["nproc"] != "default":  # one rank of a torchrun job, as run/profile
        mapped[envvars.ONE_RANK.name] = "1"
    chosen = choose_proposer(opts.proposer, offline)  # the one decision: which proposer, and why
    check_before_the_baseline(Path(script), opts, chosen)
    console = stderr_console() if json_output else stdout_console()
    os.environ.update(mapped)  # every child of this tune (baseline, trials, verification) inherits them
    try:
        result, files = pipeline.tune(Path(script), script_args or [], opts, console=console, proposer=chosen)
    finally:
        for name in mapped:
            os.environ.pop(name, None)
    if json_output:
        print(json.dumps({"result": json.loads(result.model_dump_json()),
                          "files": {k: str(v) for k, v in files.items()}}, indent=2))
    elif opts.join:  # a worker: its trials and verdicts were said as they came; the tune that started it reports
        console.print(f"worker done: {len(result.trials)} trial(s) of study {result.study!r} seen here; "
                      f"tune.json: {shown_path(Path(result.run_dir) / 'tune.json')}", markup=False)
    else:
        console.print()
        best = result.best
        if best is not None:
            console.print(f"[green bold]verified[/green bold] ({' + '.join(best.plan.effects())}): "
                          f"{escape(best.plan.describe())}")
            for line in effect_lines(best.plan, result.parameters, result.trials):
                console.print(f"  {line}", markup=False)
            console.print(f"  {best.reason}")
        elif result.interrupted:
            console.print("[yellow bold]interrupted[/yellow bold]: no change verified; what finished is in the "
                          "study, --resume continues")
        else:
            console.print("[bold]no change verified[/bold]: the baseline stays")
        TuneLines(console).host(result)
        if result.projection is not None:  # --target SLICE: an estimate, apart from what was verified
            from tpu_agent.report.projection import console_line

            console.print(f"  {console_line(result.projection)}", markup=False)
        for name in ("report.md", "patch.diff", "plan.json"):
            if name in files:
                console.print(f"  {name}: {shown_path(files[name])}")
        console.print(f"  study {result.study!r}: {dashboard_command(result.storage)}", markup=False)
    if opts.apply and result.best is not None and not opts.join:
        if "patch.diff" in files:
            apply_patch(result.best.plan, Path(script), force=opts.force, say=console.print)
        else:
            console.print("--apply: the verified plan has no source edits, nothing was written; "
                          + "; ".join(a.instruction() or a.describe() for a in result.best.plan.actions)
                          + "; `tpu-agent run SCRIPT --plan plan.json` applies them all", markup=False)
    return interrupts.exit_code() if result.interrupted else 0  # 130 for Ctrl-C, 128 + N for SIGTERM, SIGHUP


def check_before_the_baseline(script: Path, opts, proposer: ProposerChoice) -> None:
    """What would fail after minutes of measuring fails now, one line each (exit 2)."""
    from tpu_agent import envvars
    from tpu_agent.errors import InputError
    from tpu_agent.plan.patch import uncommitted_sources
    from tpu_agent.propose.playbook import PlaybookError, load_playbooks

    if opts.nproc > 1 and opts.devices > 1:  # as profile --nproc refuses it
        raise InputError(NPROC_WITH_DEVICES)
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
    if proposer.name == "claude" and not envvars.ANTHROPIC_API_KEY.get():
        raise InputError("--proposer claude needs ANTHROPIC_API_KEY in the environment "
                         "(or use --proposer offline)")


def register(app: typer.Typer) -> None:
    app.command("tune")(tune)
