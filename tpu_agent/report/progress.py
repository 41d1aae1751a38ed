"""What a tune records (tune.json) and says as its phases report, in one object: the search and the verification
call it as things happen, so neither knows about files or markup, and the pipeline's flow holds neither."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from tpu_agent import interrupts

from tpu_agent.plan.actions import Plan
from tpu_agent.propose.base import ProposalRound
from tpu_agent.propose.knobs import Knob
from tpu_agent.report.console import TuneLines
from tpu_agent.report.result import TuneResult, measured_on, summary_of
from tpu_agent.search.records import TrialRecord
from tpu_agent.search.space import Space
from tpu_agent.verify.verdict import Verdict


class TuneProgress:
    """Each report saves tune.json at once: an interrupt or a kill loses nothing measured."""

    def __init__(self, result: TuneResult, say: TuneLines, t_start: float) -> None:
        self.result, self.say, self.t_start = result, say, t_start
        self.profile = None  # the baseline's, once measured

    @property
    def console(self):
        return self.say.console

    @property
    def verdicts(self) -> list[Verdict]:
        return self.result.verdicts

    def save(self) -> TuneResult:
        return self.result.save(self.t_start)

    def enter(self, phase: str) -> None:
        self.result.enter(phase, self.t_start)

    def phase(self, name: str, work: Callable[[], None]) -> None:
        """Run a phase unless one before it was interrupted. Ctrl-C (SIGTERM and SIGHUP too, while
        interrupts.stop_signals_interrupt holds) ends it: what finished is kept, one line says what, tune.json
        is saved, and the phases after it are skipped."""
        if self.result.interrupted:
            return
        self.enter(name)
        try:
            work()
        except KeyboardInterrupt:
            self.result.mark_interrupted(interrupts.received())  # the phase tune.json says: ablation within
            self.say.interrupted(self.result)
            self.save()

    def script_failure(self, failure: tuple[int, str] | None) -> None:
        """Said once: the script itself fails after its steps, so measurements stop there."""
        if failure is not None and self.result.script_failure is None:
            steps, error = failure
            self.result.script_failure = f"the script fails after its step {steps}: {error}"
            self.say.script_failure(self.result.script_failure)

    # the baseline
    def baseline(self, profile, path: Path, seconds: float) -> None:
        result, self.profile = self.result, profile
        result.baseline_profile, result.summary = str(path), summary_of(profile, None)
        result.parameters, result.baseline_mode = [profile.parameters, None], profile.mode_used
        result.host = measured_on(profile)
        self.say.baseline_done(seconds, profile)

    def left_out(self, knobs: list[tuple[Knob, str]]) -> None:
        """Knobs out of the search's classes: all in the report, those of hot ops said."""
        self.result.left_out = [line for _, line in knobs]
        self.say.left_out([line for knob, line in knobs if knob.matched_ops][:5])

    # --target SLICE
    def projected(self, ranking) -> None:
        """The slice's plans ranked by projection so far (estimates): in tune.json after each projection."""
        self.result.projection = ranking
        self.save()

    # the search
    def round(self, number: int, round_: ProposalRound, out_of_scope: list[str], space: Space, budget: int) -> None:
        result = self.result
        result.proposer, result.proposer_notes = round_.proposer, result.proposer_notes + list(round_.notes)
        result.left_out += out_of_scope
        self.say.notes([*round_.notes, *out_of_scope])
        result.candidates = list(space.candidates)
        if not space.candidates:
            return self.say.nothing_to_search()
        self.say.round(number, space, budget, result.settings.trials, result.study)

    def trial(self, record: TrialRecord) -> None:
        self.say.trial(record)
        self.result.trials.append(record)
        self.save()

    # the verification
    def verifying(self, plan: Plan) -> None:
        self.say.verifying(plan)

    def verified(self, verdict: Verdict) -> None:
        self.result.verdicts.append(verdict)
        self.save()
        self.say.verdict(verdict)

    def unit_added(self, attribution) -> None:
        self.say.unit_added(attribution)

    def trimming(self, smaller: Plan, without: list[str], left_out: list[str]) -> None:
        self.say.trimming(smaller, without, left_out)

    def plan_profile(self, profile, path: Path) -> None:
        self.result.plan_profile = str(path)
        self.result.summary = summary_of(self.profile, self.result.best, profile)
        self.result.parameters = [self.profile.parameters, profile.parameters]

    def standing(self, verdict: Verdict | None) -> None:
        """The plan that stands now (None: none does), so that an interrupt from here on keeps it."""
        self.result.best = verdict
        if self.profile is not None:  # a joined worker that verifies never profiled the baseline
            self.result.summary = summary_of(self.profile, verdict)
