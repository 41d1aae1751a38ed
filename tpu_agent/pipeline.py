"""`tpu-agent tune`, stage by stage: run -> profile -> propose -> search -> verify -> report.

A baseline profile of the unchanged script; its knobs and the playbooks feed
a proposer, round after round; an Optuna study searches the candidates'
combinations, each trial a plan timed against a warm baseline process; the
best plans are verified in fresh processes (a confidence interval on the
gain, the numerics check) and a verified plan is ablated; the report, the
patch and the plan are written. Only verified changes are reported as gains.
"""

from __future__ import annotations

import time
from pathlib import Path

import optuna
from rich.console import Console
from rich.markup import escape

from tpu_agent.config import TuneOptions
from tpu_agent.errors import TpuAgentError
from tpu_agent.measure.runner import Runner
from tpu_agent.paths import ignore_tool_dir, new_run_dir
from tpu_agent.profilers.schema import Profile
from tpu_agent.propose import knobs as knob_finder
from tpu_agent.propose import make_proposer as _make_proposer
from tpu_agent.propose.playbook import load_playbooks
from tpu_agent.propose.scope import candidates_in_scope, knobs_in_scope
from tpu_agent.report.result import TuneResult, summary_of
from tpu_agent.run.tune_profile import profile_for_tune
from tpu_agent.search.progress import TrialProgress
from tpu_agent.search.records import TrialRecord
from tpu_agent.search.space import Space, build_space
from tpu_agent.search.study import (dashboard_command, earlier_records, note_verdicts, open_study, ranked_plans, redact,
                                    search, storage_url)
from tpu_agent.verify.ablation import settle
from tpu_agent.verify.verdict import verify


def run(script: Path, args: list[str], options: TuneOptions, *, console: Console, proposer: str = "offline",
        runs_root: Path, model: str | None = None, proposer_why: str = "") -> TuneResult:
    """The whole job; the result is written to the run directory (tune.json) as it goes."""
    t_start = time.perf_counter()
    fingerprint = options.fingerprint(script.resolve(), args)
    name = options.study or f"{script.stem}-{fingerprint[:8]}"
    held = _hold_optuna_log()  # our own lines say what happens; Optuna's, tracebacks among them, go to its log
    study = open_study(options, name, fingerprint, runs_root,  # a bad storage or study: before any run dir
                       about={"script": str(script), "args": args})
    console.print(f"proposer: {proposer}" + (f" ({proposer_why})" if proposer_why else ""))
    run_dir = new_run_dir(script, runs_root)
    _optuna_log_to(run_dir / "optuna.log", held)
    console.print(f"study {name!r}, live: {dashboard_command(storage_url(options, runs_root))}", markup=False)
    result = TuneResult(script=str(script), args=args, settings=options, study=name,
                        storage=redact(storage_url(options, runs_root)), run_dir=str(run_dir))
    result.trials = earlier_records(study)
    if result.trials:
        console.print(f"resuming study {name!r}: {len(result.trials)} trial(s) recorded earlier, not run again")

    # run + profile: the unchanged script, its knobs
    console.print(f"[bold]baseline[/bold]: profiling {script.name} ({options.warmup} warm-up + {options.steps} steps)")
    result.enter("baseline", t_start)
    began = time.perf_counter()
    try:
        profile, profile_path = profile_for_tune(script, args, run_dir, options)
    except KeyboardInterrupt:
        result.interrupted, result.interrupted_during = True, "baseline"
        console.print("[yellow]interrupted during the baseline: nothing was measured yet[/yellow]")
        result.enter("done", t_start)
        return result.save(t_start)
    result.baseline_profile, result.summary = str(profile_path), summary_of(profile, None)
    console.print(f"  {time.perf_counter() - began:.1f} s, of which {profile.steps.compile_s:.1f} s compiling "
                  f"({profile.steps.compiles} programs)")
    result.parameters = [profile.parameters, None]
    result.baseline_mode = profile.mode_used
    every_knob = knob_finder.discover(script, profile=profile, script_args=args, profile_path=str(profile_path)).knobs
    batch_knob = next((k for k in every_knob if k.batch and not k.overridden), None)
    baseline_batch = batch_knob.value if batch_knob else None
    knobs, left = knobs_in_scope(every_knob, options.allow)
    result.left_out = [line for _, line in left]
    for _, line in [x for x in left if x[0].matched_ops][:5]:  # those of the hot ops; every one is in the report
        console.print(f"[dim]{escape(line)}[/dim]")

    # propose + search, round after round
    playbooks = load_playbooks(options.playbooks)
    agent = make_proposer(proposer, audit_dir=run_dir / "agent", model=model, token_budget=options.token_budget,
                          script=script)
    runner, baseline_losses, space = Runner(script, args, options, run_dir), {}, Space(candidates=[])
    runner.fresh_baselines = profile.recompiling is not None  # each trial's baseline sees the batches from the start

    def note_script_failure() -> None:
        """Said once: the script itself fails after its steps, so measurements stop there."""
        if runner.script_failure is not None and result.script_failure is None:
            steps, error = runner.script_failure
            result.script_failure = f"the script fails after its step {steps}: {error}"
            console.print(f"[yellow]{escape(result.script_failure)}; the steps before it are measured[/yellow]")

    def on_trial(record: TrialRecord):
        note_script_failure()
        shown = f"{record.speedup:.3f}x" if record.speedup is not None else "-"
        log = f" (logs/trial-{record.number}.log)" if record.state == "failed" else ""
        console.print(f"  trial {record.number:3d} {record.state:9s} {shown:>8s}  {record.plan.describe()}"
                      + (f"  [dim]{escape(record.reason[:90])}{log}[/dim]"
                         if record.reason and record.state != "complete" else ""))
        result.trials.append(record)
        result.save(t_start)
        bar.advance()

    bar = TrialProgress(console, options.trials, done=len(result.trials))
    result.enter("search", t_start)
    try:
        for round_number in range(1, options.rounds + 1):
            round_ = agent.propose(profile, knobs, playbooks, [t.outcome() for t in result.trials if not t.earlier],
                                   round_number)  # this run's trials: a resumed study keeps its search space
            round_, out_of_scope = candidates_in_scope(round_, options.allow)
            result.proposer = round_.proposer
            result.proposer_notes += list(round_.notes)
            result.left_out += out_of_scope
            for note in [*round_.notes, *out_of_scope]:
                console.print(f"[yellow]{escape(note)}[/yellow]")
            space = build_space(round_, options.candidates, space)
            result.candidates = list(space.candidates)
            if not space.candidates:
                console.print("no candidate changes for this profile: nothing to search")
                break
            budget = options.trials * round_number // options.rounds
            console.print(f"[bold]search[/bold] (round {round_number}): {len(space.candidates)} candidates, "
                          f"trials up to {budget} of {options.trials} (study {name!r})")
            for c in space.candidates:
                console.print(f"  {c.rank}. {c.title} [dim]({c.proposer}, {len(space.options[c.id])} options)[/dim]")
            with bar:
                search(study, space, runner, options.model_copy(update={"trials": budget}), baseline_batch,
                       baseline_losses, on_trial=on_trial)
    except KeyboardInterrupt:
        result.interrupted, result.interrupted_during = True, "search"
        console.print("[yellow]interrupted during the search: finished trials are saved in the study; --resume continues[/yellow]")
    finally:
        runner.close()

    # verify the best plans in fresh processes; ablate the first verified one
    result.enter("verification", t_start)
    try:
        if options.verify == 0 and not result.interrupted:
            console.print("[bold]verify[/bold]: none (--verify 0): the trials' figures are search measurements, "
                          "not verified gains")
        for plan in ([] if result.interrupted else ranked_plans(study)[:options.verify]):
            console.print(f"[bold]verify[/bold]: {escape(plan.describe())} ({' + '.join(plan.effects())}; "
                          "fresh processes, interleaved pairs)")
            verdict = verify(plan, runner, options, baseline_batch, profile)
            note_script_failure()
            result.verdicts.append(verdict)
            result.save(t_start)
            console.print(("  [green]accepted[/green]: " if verdict.accepted else "  [red]rejected[/red]: ")
                          + verdict.reason)
            if verdict.accepted:
                # verified: kept as it stands if the ablation is interrupted
                result.best, result.summary = verdict, summary_of(profile, verdict)
                if options.objective != "memory" and not verdict.estimate_note:
                    result.enter("ablation", t_start)
                    verdict = settle(verdict, runner, options, baseline_batch, profile, console, result.verdicts)
                    result.enter("verification", t_start)
                if verdict.accepted:
                    result.best, result.summary = verdict, summary_of(profile, verdict)
                    break
                result.best, result.summary = None, summary_of(profile, None)  # its gain needed what was left out
    except KeyboardInterrupt:
        phase = result.phase  # the phase tune.json says was running
        result.interrupted, result.interrupted_during = True, phase
        kept = f"; the verified plan stands ({result.best.plan.describe()})" if result.best else ""
        console.print(f"[yellow]interrupted during the {phase}: {len(result.verdicts)} finished verification(s) "
                      f"kept{kept}; the study keeps every trial, --resume verifies again[/yellow]")
    finally:
        runner.close()
        note_verdicts(study, result.verdicts, result.best)
    if result.best is not None and not result.interrupted:
        profile_plan(script, args, run_dir, options, result, profile, console, t_start)
    result.enter("done", t_start)
    return result.save(t_start)


def profile_plan(script: Path, args: list[str], run_dir: Path, options: TuneOptions, result: TuneResult,
                 baseline: Profile, console: Console, t_start: float) -> None:
    """Profile the verified plan as the baseline was, so that report.json's summary has every figure `diff`
    compares (FLOPs, MFU, XLA peak memory), measured; a plan that changes the batch is compared per sample,
    which a per-step summary cannot say, so it keeps the baseline's figures."""
    best = result.best
    if best.speed is not None and best.speed.per_sample:
        return
    console.print(f"[bold]profile[/bold]: the verified plan ({options.warmup} warm-up + {options.steps} steps), "
                  "for the report's summary")
    result.enter("profile", t_start)
    try:
        measured, path = profile_for_tune(script, args, run_dir, options, plan=best.plan)
    except KeyboardInterrupt:
        result.interrupted, result.interrupted_during = True, "profile"
        console.print("[yellow]interrupted during the profile of the verified plan: the plan stands; the summary has "
                      "its verified step time only[/yellow]")
        return
    except TpuAgentError as exc:
        console.print(f"[yellow]the verified plan's profile failed: {escape(str(exc))}; the summary has its "
                      "verified step time only[/yellow]")
        return
    result.plan_profile, result.summary = str(path), summary_of(baseline, best, measured)
    result.parameters = [baseline.parameters, measured.parameters]


def _hold_optuna_log():
    """Optuna's messages off stderr and held in memory until the run directory exists."""
    from logging.handlers import MemoryHandler

    optuna.logging.set_verbosity(optuna.logging.INFO)
    optuna.logging.disable_default_handler()
    held = MemoryHandler(capacity=10_000, flushLevel=100)  # above CRITICAL: flushed only when told
    optuna.logging.get_logger("optuna").addHandler(held)
    return held


def _optuna_log_to(path: Path, held) -> None:
    """Optuna's messages (a failed trial's traceback among them) into the run directory, not on stderr."""
    import logging

    handler = logging.FileHandler(path, delay=True)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    logger = optuna.logging.get_logger("optuna")
    held.setTarget(handler)
    held.flush()
    logger.removeHandler(held)
    logger.addHandler(handler)


def make_proposer(proposer: str, *, audit_dir: Path, model: str | None, token_budget: int, script: Path):
    """The offline proposer, or Claude (which falls back to the offline one itself, out loud)."""
    options = {"audit_dir": audit_dir, "token_budget": token_budget, "source_root": script.resolve().parent}
    if model:
        options["model"] = model
    return _make_proposer(proposer, **options)



def tune(script: Path, args: list[str], options: TuneOptions, *, console: Console,
         proposer: str, proposer_why: str = "") -> tuple[TuneResult, dict[str, Path]]:
    """run(), then the report: report.md, report.json, patch.diff, plan.json, plots."""
    from tpu_agent.report.markdown import write_all

    runs_root = options.runs_root()
    runs_root.parent.mkdir(parents=True, exist_ok=True)  # the studies' SQLite file; run dirs come after the checks
    ignore_tool_dir(runs_root.parent)
    result = run(script, args, options, console=console, proposer=proposer, runs_root=runs_root, model=options.model,
                 proposer_why=proposer_why)
    return result, write_all(result, script)
