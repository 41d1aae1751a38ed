"""`tpu-agent tune`, stage by stage: run -> profile -> propose -> search -> verify -> report.

The measuring context (measure.context.Measuring: runner, options, the baseline's batch, profile and losses) is
built once and handed to the search and the verification; what a phase finds goes to one recorder
(report.progress.TuneProgress), which writes tune.json as it goes, says it, and is every phase's one interrupt
path. Only verified changes are reported as gains. `--join STUDY` is the same pipeline for a worker: its search
phase measures another tune's study, and its verification phase runs only on the --verify-on host.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

from rich.console import Console

from tpu_agent import interrupts
from tpu_agent.config import ChosenProposer, TuneOptions
from tpu_agent.errors import TpuAgentError
from tpu_agent.measure.context import Measuring
from tpu_agent.measure.runner import Runner
from tpu_agent.paths import ignore_tool_dir, new_run_dir, writable_dir
from tpu_agent.parallelism import target
from tpu_agent.parallelism.alone import actions_tried, measure_alone
from tpu_agent.parallelism.measured import measured_plans
from tpu_agent.propose import ProposerChoice, make_proposer
from tpu_agent.propose.knobs import discover
from tpu_agent.propose.scope import knobs_in_scope
from tpu_agent.report.console import TuneLines, ranks_lines
from tpu_agent.report.progress import TuneProgress
from tpu_agent.report.result import TuneResult
from tpu_agent.run.tune_profile import profile_for_tune
from tpu_agent.search import study as studies
from tpu_agent.search.rounds import search_rounds
from tpu_agent.verify.best import verify_best


def tune(script: Path, args: list[str], options: TuneOptions, *, console: Console,
         proposer: ProposerChoice | ChosenProposer) -> tuple[TuneResult, dict[str, Path]]:
    """run(), then the report: report.md, report.json, patch.diff, plan.json, plots. SIGTERM and SIGHUP stop it
    as Ctrl-C does (the exit code says which: interrupts.exit_code)."""
    from tpu_agent.report.markdown import write_all

    runs_root = options.runs_root()
    writable_dir(runs_root.parent, "the tool's folder")  # the studies' SQLite file; run dirs come after the checks
    ignore_tool_dir(runs_root.parent)
    with interrupts.stop_signals_interrupt():
        if options.join:  # a worker: the tune that started the study writes the report
            return join(script, args, options, console=console, runs_root=runs_root), {}
        result = run(script, args, options, console=console, proposer=proposer, runs_root=runs_root)
        return result, write_all(result, script)


def run(script: Path, args: list[str], options: TuneOptions, *, console: Console,
        proposer: ProposerChoice | ChosenProposer = "offline", runs_root: Path) -> TuneResult:
    """The whole job, phase after phase; tune.json in the run directory says how far it got."""
    chosen = proposer if isinstance(proposer, ProposerChoice) else ProposerChoice(name=proposer, why="")
    study, out = _start(script, args, options, TuneLines(console), chosen, runs_root)
    run_dir = Path(out.result.run_dir)
    runner = Runner(script, args, options, run_dir)
    measuring = Measuring(runner, options)  # the batch and the profile are the baseline's, once it has run
    knobs = []  # the knobs in the search's classes

    def baseline() -> None:  # run + profile the unchanged script; its knobs
        nonlocal knobs
        out.say.baseline(script.name, options)
        began = time.perf_counter()
        profile, path = profile_for_tune(script, args, run_dir, options)
        out.baseline(profile, path, time.perf_counter() - began)
        for line in ranks_lines(profile):  # --nproc: each rank's step time and memory
            out.console.print(line, markup=False)
        every_knob = discover(script, profile=profile, script_args=args, profile_path=str(path)).knobs
        measuring.profile = profile
        measuring.baseline_batch = next((k.value for k in every_knob if k.batch and not k.overridden), None)
        knobs, left_out = knobs_in_scope(every_knob, options.allow)
        out.left_out(left_out)

    def projection() -> None:  # --target SLICE: the slice's plans ranked by projection (estimates, never verified)
        say = lambda line: out.console.print(line, markup=False)  # noqa: E731
        try:
            target.for_tune(str(script), args, options.slice, out.profile, measuring.baseline_batch, say,
                            keep=out.projected)
        except TpuAgentError as exc:  # the measured tune goes on
            say(f"projection: not run: {exc}")

    def search() -> None:  # propose + search, round after round
        claude = {"audit_dir": run_dir / "agent", "token_budget": options.token_budget,
                  "source_root": script.resolve().parent, **({"model": options.model} if options.model else {})}
        search_rounds(study, measuring, make_proposer(chosen, **claude), knobs, out, done=len(out.result.trials))
        # The search's warm baseline stays up: verification starts fresh processes (it closes it), and --nproc's
        # parallelism step after a search alone (--verify 0) measures against it rather than a new N-rank job.

    def verification() -> None:
        if not options.verify:
            return out.say.verify_none()
        if options.verify_on and options.verify_on != socket.gethostname():  # a joined worker there verifies
            return out.say.console.print(f"verify: on {options.verify_on} (--verify-on), not on this host; its "
                                         "verdicts go into the study's attributes", markup=False)
        verify_best(studies.ranked_plans(study), measuring, out)

    def parallelism() -> None:  # --nproc N: each parallelism plan's memory per rank; --target: ranked by projection
        platform = out.profile.device.platform if out.profile.device is not None else "this host"
        measured = measured_plans(out.result.trials, options.nproc, f"this host ({platform}, "
                                  f"{options.nproc} processes under torch.distributed.run)")
        if measured is None:
            return
        out.result.parallelism = measured  # the trials' rows, kept if what follows is interrupted
        say = lambda line: out.console.print(line, markup=False)  # noqa: E731
        say("parallelism: each action the search tried, alone against the baseline, for its memory per rank")
        alone = measure_alone(actions_tried([row.plan for row in measured.plans]), runner, say)
        runner.close()
        measured = measured.model_copy(update={"plans": [*alone, *measured.plans]})
        if out.result.projection is not None:  # --target on a host that is not the slice
            measured = target.for_measured(measured, out.result.projection, str(script), args, options.slice,
                                           measuring.baseline_batch, say)
        out.result.parallelism = measured
        out.say.parallelism(measured)
        out.save()

    def profile_plan() -> None:  # every figure `diff` compares, measured with the verified plan
        out.say.plan_profile(options)
        try:
            out.plan_profile(*profile_for_tune(script, args, run_dir, options, plan=out.result.best.plan))
        except TpuAgentError as exc:
            out.say.plan_profile_failed(str(exc))

    out.phase("baseline", baseline)
    if options.slice is not None:
        out.phase("projection", projection)
    try:
        out.phase("search", search)
        out.phase("verification", verification)
        if options.nproc > 1 and out.profile is not None:
            out.phase("projection" if options.slice is not None else "verification", parallelism)
    finally:
        runner.close()
        if out.profile is not None:
            studies.note_verdicts(study, out.result.verdicts, out.result.best)
    best = out.result.best
    if best is not None and not (best.speed is not None and best.speed.per_sample):  # per sample: no step figures
        out.phase("profile", profile_plan)
    out.enter("done")
    return out.save()


def join(script: Path, args: list[str], options: TuneOptions, *, console: Console, runs_root: Path) -> TuneResult:
    """`--join STUDY`: this host's workers (this process and --workers - 1 more) measure the study's plans, round
    after round of the tune that started it; with --verify-on this host, once no trial runs, the study's best plans
    are verified here and the verdicts go into the study's attributes. tune.json in the worker's run directory says
    how far it got; no report."""
    from tpu_agent.search import worker
    from tpu_agent.search.workers import Crew

    study = studies.joined_study(script, args, options)  # bad input: one line, before any run directory
    run_dir = runs_root / f"{time.strftime('%Y%m%d-%H%M%S')}-{script.stem}-worker-{os.getpid()}"
    run_dir.mkdir(parents=True, exist_ok=True)
    result = TuneResult(script=str(script), args=args, settings=options, study=options.join,
                        storage=studies.redact(studies.storage_url(options, runs_root)), run_dir=str(run_dir))
    out = TuneProgress(result, TuneLines(console), time.perf_counter())

    def search() -> None:  # this process and --workers - 1 more, each a worker of the study
        say = lambda line: console.print(line, markup=False)  # noqa: E731
        with Crew(options.workers - 1, script, args, run_dir, options, options.join, say, rounds=True):
            worker.join(script, args, options, run_dir, say=say, on_trial=out.trial, study=study)

    def verification() -> None:  # the study's trials over (other workers' too), in fresh processes
        while studies.busy(study):
            time.sleep(2.0)
        runner = Runner(script, args, options, run_dir)
        try:
            verify_best(studies.ranked_plans(study), Measuring(runner, options, study.user_attrs.get("baseline_batch")),
                        out)
        finally:
            runner.close()

    out.phase("search", search)
    if options.verify_on and options.verify_on == socket.gethostname():
        try:
            out.phase("verification", verification)
        finally:
            studies.note_verdicts(study, result.verdicts, result.best)
    out.enter("done")
    return out.save()


def _start(script: Path, args: list[str], options: TuneOptions, say: TuneLines, proposer: ProposerChoice,
           runs_root: Path):
    """The study opened (a bad storage or study fails before any run directory), the run directory, the trials
    an earlier run of the study recorded."""
    t_start, fingerprint = time.perf_counter(), options.fingerprint(script.resolve(), args)
    name = options.study or f"{script.stem}-{fingerprint[:8]}"
    held = studies.hold_optuna_log()  # our lines say what happens; Optuna's, tracebacks among them, go to its log
    study = studies.open_study(options, name, fingerprint, runs_root, about={"script": str(script), "args": args})
    say.proposer(proposer.name, proposer.why)
    run_dir = new_run_dir(script, runs_root)
    studies.optuna_log_to(run_dir / "optuna.log", held)
    url = studies.storage_url(options, runs_root)
    say.study(name, studies.dashboard_command(url))
    result = TuneResult(script=str(script), args=args, settings=options, study=name, storage=studies.redact(url),
                        run_dir=str(run_dir), trials=studies.earlier_records(study))
    say.resuming(name, len(result.trials))
    return study, TuneProgress(result, say, t_start)
