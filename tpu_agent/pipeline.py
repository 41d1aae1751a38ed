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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from rich.console import Console

from tpu_agent import interrupts
from tpu_agent.config import ChosenProposer, TuneOptions
from tpu_agent.errors import TpuAgentError
from tpu_agent.measure.runner import Runner
from tpu_agent.paths import ignore_tool_dir, new_run_dir, writable_dir
from tpu_agent.profilers.schema import Profile
from tpu_agent.propose import knobs as knob_finder
from tpu_agent.propose import ProposerChoice
from tpu_agent.propose import make_proposer as _make_proposer
from tpu_agent.propose.playbook import load_playbooks
from tpu_agent.propose.scope import candidates_in_scope, knobs_in_scope
from tpu_agent.report.console import TuneLines
from tpu_agent.report.result import TuneResult, summary_of
from tpu_agent.run.tune_profile import profile_for_tune
from tpu_agent.search.progress import TrialProgress
from tpu_agent.search.space import Space, build_space
from tpu_agent.search.study import (dashboard_command, earlier_records, hold_optuna_log, note_verdicts, open_study,
                                    optuna_log_to, ranked_plans, redact, search, storage_url)
from tpu_agent.verify.ablation import settle
from tpu_agent.verify.verdict import verify


def run(script: Path, args: list[str], options: TuneOptions, *, console: Console,
        proposer: ProposerChoice | ChosenProposer = "offline", runs_root: Path, model: str | None = None) -> TuneResult:
    """The whole job; the result is written to the run directory (tune.json) as it goes. `proposer`: the CLI's
    choice (choose_proposer), or a name already chosen."""
    chosen = proposer if isinstance(proposer, ProposerChoice) else ProposerChoice(name=proposer, why="")
    t = _start(script, args, options, TuneLines(console), chosen, runs_root, model)
    t.phase("baseline", baseline)
    try:
        t.phase("search", search_rounds)
        t.phase("verification", verify_best)
    finally:
        t.runner.close()
        if t.profile is not None:
            note_verdicts(t.study, t.result.verdicts, t.result.best)
    best = t.result.best
    if best is not None and not (best.speed is not None and best.speed.per_sample):  # per sample: no step figures
        t.phase("profile", profile_plan)
    t.result.enter("done", t.t_start)
    return t.result.save(t.t_start)


@dataclass
class _Tune:
    """A tune's state, as its phases fill it in; `phase` is every phase's one interrupt path."""
    script: Path
    args: list[str]
    options: TuneOptions
    say: TuneLines
    study: Any
    result: TuneResult
    runner: Runner
    t_start: float
    proposer: dict
    profile: Profile | None = None
    knobs: list = field(default_factory=list)
    baseline_batch: int | None = None

    def phase(self, name: str, work: Callable[[_Tune], None]) -> None:
        """Run a phase unless one before it was interrupted. Ctrl-C (SIGTERM and SIGHUP too, while
        interrupts.stop_signals_interrupt holds) ends it: what finished is kept, one line says what, tune.json
        is saved, and the phases after it are skipped."""
        if self.result.interrupted:
            return
        self.result.enter(name, self.t_start)
        try:
            work(self)
        except KeyboardInterrupt:
            self.result.mark_interrupted(interrupts.received())  # in the phase tune.json says: ablation within
            self.say.interrupted(self.result)
            self.result.save(self.t_start)

    def note_script_failure(self) -> None:
        """Said once: the script itself fails after its steps, so measurements stop there."""
        if self.runner.script_failure is not None and self.result.script_failure is None:
            steps, error = self.runner.script_failure
            self.result.script_failure = f"the script fails after its step {steps}: {error}"
            self.say.script_failure(self.result.script_failure)


def _start(script, args, options, say, proposer: ProposerChoice, runs_root, model) -> _Tune:
    """The study opened (a bad storage or study fails before any run directory), the run directory, the trials
    an earlier run of the study recorded."""
    t_start, fingerprint = time.perf_counter(), options.fingerprint(script.resolve(), args)
    name = options.study or f"{script.stem}-{fingerprint[:8]}"
    held = hold_optuna_log()  # our own lines say what happens; Optuna's, tracebacks among them, go to its log
    study = open_study(options, name, fingerprint, runs_root, about={"script": str(script), "args": args})
    say.proposer(proposer.name, proposer.why)
    run_dir = new_run_dir(script, runs_root)
    optuna_log_to(run_dir / "optuna.log", held)
    say.study(name, dashboard_command(storage_url(options, runs_root)))
    result = TuneResult(script=str(script), args=args, settings=options, study=name,
                        storage=redact(storage_url(options, runs_root)), run_dir=str(run_dir))
    result.trials = earlier_records(study)
    say.resuming(name, len(result.trials))
    return _Tune(script, args, options, say, study, result, Runner(script, args, options, run_dir), t_start,
                 dict(proposer=proposer.name, audit_dir=run_dir / "agent", model=model, script=script,
                      token_budget=options.token_budget))


def baseline(t: _Tune) -> None:
    """run + profile: the unchanged script; its knobs, those of the search's classes."""
    t.say.baseline(t.script.name, t.options)
    began = time.perf_counter()
    profile, path = profile_for_tune(t.script, t.args, Path(t.result.run_dir), t.options)
    t.result.baseline_profile, t.result.summary = str(path), summary_of(profile, None)
    t.say.baseline_done(time.perf_counter() - began, profile)
    t.result.parameters, t.result.baseline_mode = [profile.parameters, None], profile.mode_used
    every_knob = knob_finder.discover(t.script, profile=profile, script_args=t.args, profile_path=str(path)).knobs
    batch_knob = next((k for k in every_knob if k.batch and not k.overridden), None)
    t.baseline_batch = batch_knob.value if batch_knob else None
    t.knobs, left = knobs_in_scope(every_knob, t.options.allow)
    t.result.left_out = [line for _, line in left]
    t.say.left_out([line for knob, line in left if knob.matched_ops][:5])  # the hot ops'; all are in the report
    t.profile = profile


def search_rounds(t: _Tune) -> None:
    """propose + search, round after round; each trial on disk (the study, tune.json) as it ends."""
    result, options, space, baseline_losses = t.result, t.options, Space(candidates=[]), {}
    agent, playbooks = make_proposer(**t.proposer), load_playbooks(options.playbooks)
    t.runner.fresh_baselines = t.profile.recompiling is not None  # each trial's baseline sees the batches anew
    bar = TrialProgress(t.say.console, options.trials, done=len(result.trials))

    def on_trial(record) -> None:
        t.note_script_failure()
        t.say.trial(record)
        result.trials.append(record)
        result.save(t.t_start)
        bar.advance()

    for number in range(1, options.rounds + 1):
        round_ = agent.propose(t.profile, t.knobs, playbooks, [r.outcome() for r in result.trials if not r.earlier],
                               number)  # this run's trials: a resumed study keeps its search space
        round_, out_of_scope = candidates_in_scope(round_, options.allow)
        result.proposer, result.proposer_notes = round_.proposer, result.proposer_notes + list(round_.notes)
        result.left_out += out_of_scope
        t.say.notes([*round_.notes, *out_of_scope])
        space = build_space(round_, options.candidates, space)
        result.candidates = list(space.candidates)
        if not space.candidates:
            return t.say.nothing_to_search()
        budget = options.trials * number // options.rounds
        t.say.round(number, space, budget, options.trials, result.study)
        with bar:
            search(t.study, space, t.runner, options.model_copy(update={"trials": budget}), t.baseline_batch,
                   baseline_losses, on_trial=on_trial)


def verify_best(t: _Tune) -> None:
    """The best plans verified in fresh processes; the first accepted one ablated (a verified plan stands if the
    ablation is interrupted)."""
    result, options = t.result, t.options
    t.runner.close()
    if options.verify == 0:
        t.say.verify_none()
    for plan in ranked_plans(t.study)[:options.verify]:
        t.say.verifying(plan)
        verdict = verify(plan, t.runner, options, t.baseline_batch, t.profile)
        t.note_script_failure()
        result.verdicts.append(verdict)
        result.save(t.t_start)
        t.say.verdict(verdict)
        if verdict.accepted:
            result.best, result.summary = verdict, summary_of(t.profile, verdict)
            if options.objective != "memory" and not verdict.estimate_note:
                result.enter("ablation", t.t_start)
                verdict = settle(verdict, t.runner, options, t.baseline_batch, t.profile, t.say.console,
                                 result.verdicts)
                result.enter("verification", t.t_start)
            if verdict.accepted:
                result.best, result.summary = verdict, summary_of(t.profile, verdict)
                return
            result.best, result.summary = None, summary_of(t.profile, None)  # its gain needed what was left out


def profile_plan(t: _Tune) -> None:
    """Profile the verified plan as the baseline was, so that report.json's summary has every figure `diff`
    compares (FLOPs, MFU, XLA peak memory), measured (a plan that changes the batch is compared per sample,
    which a per-step summary cannot say, so it keeps the baseline's figures: not profiled)."""
    best = t.result.best
    t.say.plan_profile(t.options)
    try:
        measured, path = profile_for_tune(t.script, t.args, Path(t.result.run_dir), t.options, plan=best.plan)
    except TpuAgentError as exc:
        return t.say.plan_profile_failed(str(exc))
    t.result.plan_profile, t.result.summary = str(path), summary_of(t.profile, best, measured)
    t.result.parameters = [t.profile.parameters, measured.parameters]


def make_proposer(proposer: ChosenProposer = "offline", *, audit_dir: Path, model: str | None, token_budget: int,
                  script: Path):
    """The offline proposer, or Claude (which falls back to the offline one itself, out loud)."""
    options = {"audit_dir": audit_dir, "token_budget": token_budget, "source_root": script.resolve().parent}
    if model:
        options["model"] = model
    return _make_proposer(proposer, **options)


def tune(script: Path, args: list[str], options: TuneOptions, *, console: Console,
         proposer: ProposerChoice | ChosenProposer) -> tuple[TuneResult, dict[str, Path]]:
    """run(), then the report: report.md, report.json, patch.diff, plan.json, plots. SIGTERM and SIGHUP stop it
    as Ctrl-C does (the exit code says which: interrupts.exit_code)."""
    from tpu_agent.report.markdown import write_all

    runs_root = options.runs_root()
    writable_dir(runs_root.parent, "the tool's folder")  # the studies' SQLite file; run dirs come after the checks
    ignore_tool_dir(runs_root.parent)
    with interrupts.stop_signals_interrupt():
        result = run(script, args, options, console=console, proposer=proposer, runs_root=runs_root,
                     model=options.model)
        return result, write_all(result, script)
