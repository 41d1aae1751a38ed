"""Measuring plans: a warm baseline process and one candidate process per trial, stepped in turns (A B A B ...)."""

from __future__ import annotations

import math
import time
from pathlib import Path

from tpu_agent import envvars
from tpu_agent.config import MIN_PAIRS, TuneOptions
from tpu_agent.errors import TpuAgentError
from tpu_agent.measure import slots
from tpu_agent.measure.trials import StepRecord, TrialFailed, TrialProcess
from tpu_agent.plan.actions import Compile, PadBatch, PadDim, Plan

MIN_PAIRS_AT_END = MIN_PAIRS  # pairs a script that ends early must have given for them to count (an interval's)


class BaselineNotFinite(TpuAgentError):
    """The unchanged script's loss is NaN or infinite (exit 1): no plan can be compared against it."""


def finite(record: StepRecord, proc: TrialProcess, baseline: bool = False) -> StepRecord:
    """The step, if its loss is a number: a candidate whose loss is NaN or infinite fails its trial; a baseline's
    stops the tune (every comparison against it would be meaningless)."""
    if record.loss is None or math.isfinite(record.loss):
        return record
    where = f"loss is {record.loss} at step {record.step}"
    if baseline:
        raise BaselineNotFinite(f"the unchanged script's {where}: there is nothing to compare plans against "
                                f"(its output is in {proc.log_dir / (proc.name + '.log')})")
    raise TrialFailed("not_finite", f"the {where}", steps=record.step)


def interleave(step_a, step_b, pairs: int, report=None, ends_script=None) -> tuple[list[StepRecord], list[StepRecord]]:
    """A B A B ... for `pairs` pairs, or until `report` (called after each pair) returns True; when the script's
    own end stops a side (its step count, or its own failure after its steps: `ends_script`), the pairs so far
    (at least MIN_PAIRS_AT_END)."""
    a: list[StepRecord] = []
    b: list[StepRecord] = []
    for i in range(pairs):
        try:
            with slots.held():  # a pair is timed alone on this host
                first = step_a()
                second = step_b()
        except TrialFailed as exc:
            at_end = exc.kind == "too_few_steps" or (ends_script is not None and ends_script(exc))
            if not at_end or len(b) < MIN_PAIRS_AT_END:
                raise
            break
        a.append(first)
        b.append(second)
        if report is not None and report(i, a, b):  # True: enough pairs (a verification round's steady ones)
            break
    return a, b


def steady_enough(wanted: int):
    """A pair report that says "enough" once `wanted` pairs without compilation are in: a verification round
    measures that many steady pairs (up to --steps pairs), however long the script's first compiles last."""
    def enough(i: int, a: list[StepRecord], b: list[StepRecord]) -> bool:
        return sum(not (x.compiled or y.compiled) for x, y in zip(a, b)) >= wanted
    return enough


class Runner:
    """Runs trials: a warm baseline process, one candidate process per trial, stepped in turns."""

    def __init__(self, script: Path, args: list[str], options: TuneOptions, run_dir: Path):
        self.script, self.args, self.options, self.run_dir = script, args, options, run_dir
        self.env = {envvars.DEVICES.name: str(options.devices)} if options.devices > 1 else {}
        self.baseline: TrialProcess | None = None
        self.baseline_count = 0
        self.verifications = 0
        self.last_baseline_steps: list[StepRecord] = []
        self.script_failure: tuple[int, str] | None = None  # (steps, error): the unchanged script fails after them
        # A baseline that compiles new shapes as they come stops compiling once it has seen them all: a warm one
        # would be timed on later batches than the candidate. Set for such scripts: a fresh baseline per trial.
        self.fresh_baselines = False
        self._names: dict[str, int] = {}

    def _baseline(self) -> TrialProcess:
        if self.baseline is None or self.baseline.proc is None or self.baseline.proc.poll() is not None:
            if self.baseline is not None:  # it ran out of steps: keep what it measured (losses by step)
                self.last_baseline_steps.extend(self.baseline.steps)
            self.baseline_count += 1
            self.baseline = self.process(Plan(), f"baseline-{self.baseline_count}")
            self._warm(self.baseline, baseline=True)
        return self.baseline

    def _unique(self, name: str) -> str:
        """`name`, or `name-2`, `name-3`...: the smaller plan's ablation measures the same units again, and each
        process keeps its own log and workspace."""
        self._names[name] = self._names.get(name, 0) + 1
        return name if self._names[name] == 1 else f"{name}-{self._names[name]}"

    def process(self, plan: Plan, name: str) -> TrialProcess:
        """A process (not started) running the script with `plan`: its source edits on a copy of the script."""
        name = self._unique(name)
        script = self.script
        if plan.of(PadDim):
            from tpu_agent.plan.rewrite import apply_pad_dims

            script = apply_pad_dims(plan, self.script, self.run_dir / "workspaces" / name).script
        return TrialProcess(script, self.args, plan, cwd=Path.cwd(), log_dir=self.run_dir / "logs",
                            step_timeout=self.options.trial_timeout, env=self.env, name=name,
                            nproc=self.options.nproc)

    def measure(self, plan: Plan, name: str, pairs: int, report=None, fresh_baseline: bool = False):
        """(baseline steps, candidate steps, the candidate's process), interleaved."""
        if fresh_baseline or self.fresh_baselines:
            self.close()
            self.last_baseline_steps = []
        base = self._baseline()

        def baseline_step() -> StepRecord:
            nonlocal base
            try:
                return finite(base.step(), base, baseline=True)
            except TrialFailed as exc:
                if exc.kind != "too_few_steps" and not self._script_ends(exc, baseline=True):
                    raise
                base = self._baseline()  # the script ran out of steps: a fresh warm baseline
                return finite(base.step(), base, baseline=True)

        cand = self.process(plan, name)
        try:
            self._warm(cand, programs=self._may_be_no_op(plan))
            same = self._same_programs(base, cand)
            if same is not None:
                raise TrialFailed("no_change", same)
            a, b = interleave(baseline_step, lambda: finite(cand.step(), cand), pairs, report,
                              ends_script=self._script_ends)
            return a, b, cand
        finally:
            cand.stop()

    def _script_ends(self, exc: TrialFailed, baseline: bool = False) -> bool:
        """Whether a crash is the script's own end: the unchanged script failed after all of its steps (a
        checkpoint reload that fails, say), and a plan's process failed after the same steps. Measured steps
        before it count; the failure is reported once (`script_failure`)."""
        if exc.kind != "crashed" or exc.steps is None or exc.steps <= self.options.warmup:
            return False
        if baseline and self.script_failure is None:
            self.script_failure = (exc.steps, exc.message.splitlines()[0][:300])
        return self.script_failure is not None and self.script_failure[0] == exc.steps

    def measure_plans(self, without: Plan, plan: Plan, name: str):
        """Two fresh plan processes stepped in turns, in a verification's rounds (each round a fresh process pair
        of `round_pairs` pairs): (steps of `without`, steps of `plan`); a process's steps count from 1, so the
        rounds can be told apart (compare.process_pairs)."""
        self.close()
        a: list[StepRecord] = []
        b: list[StepRecord] = []
        for _ in range(self.options.verify_rounds):
            a_proc, b_proc = self.process(without, f"{name}-without"), self.process(plan, f"{name}-with")
            try:
                unit = Plan(actions=[x for x in plan.actions if x not in without.actions])
                fingerprint = not a and self._may_be_no_op(unit)  # the first round tells
                self._warm(a_proc, programs=fingerprint)
                self._warm(b_proc, programs=fingerprint)
                same = self._same_programs(a_proc, b_proc) if fingerprint else None
                if same is not None:
                    raise TrialFailed("no_change", same)
                ra, rb = interleave(lambda: finite(a_proc.step(), a_proc), lambda: finite(b_proc.step(), b_proc),
                                    self.options.steps, steady_enough(self.options.round_pairs),
                                    ends_script=self._script_ends)
            finally:
                a_proc.stop()
                b_proc.stop()
            a, b = a + ra, b + rb
        return a, b

    def _may_be_no_op(self, plan: Plan) -> bool:
        """Whether the same programs would mean the same run (measure/noop.py's rules read the profile; this one
        the programs): one process, a script whose shapes do not change from step to step (a padding could
        leave one step's programs alone and change another's), no source edit, no other execution mode (the
        same programs dispatched another way are not the same run)."""
        return (self.options.nproc <= 1 and not self.fresh_baselines and not plan.of(PadDim)
                and not plan.of(Compile) and not plan.of(PadBatch) and bool(plan.actions))

    def _same_programs(self, base: TrialProcess, cand: TrialProcess) -> str | None:
        """"no change" in one line when the candidate's last warm-up step ran exactly the programs of a steady
        step of the baseline, as often (run/programs.py); None when they differ or that is not known."""
        if getattr(cand, "programs", None) is None:
            return None
        if getattr(base, "programs", None) is None:
            try:  # one step of the warm baseline, fingerprinted (not timed: no pair is measured from it)
                with slots.held():
                    record = base.step(programs=True)
            except TrialFailed:
                return None
            base.programs = None if record.compiled else record.programs
        if base.programs is None or base.programs != cand.programs:
            return None
        return ("no change: its step runs the baseline's XLA programs, each as often "
                f"({cand.programs.split(':')[0]} programs, fingerprints equal): not measured")

    def _warm(self, proc: TrialProcess, baseline: bool = False, programs: bool = False) -> None:
        """Start-up and warm-up (imports, compiles) hold a slot too: they would load another worker's pairs. An
        N-rank job holds one slot, as one measurement: its ranks take none of their own. With `programs`, the
        last warm-up step says which programs it ran."""
        with slots.held():
            t0 = time.perf_counter()
            proc.start()
            for i in range(self.options.warmup):
                fingerprint = programs and i == self.options.warmup - 1
                record = finite(proc.step(programs=True) if fingerprint else proc.step(), proc, baseline)
            proc.warm_s = time.perf_counter() - t0
        if programs:  # a step that compiled is not yet the steady one: nothing is claimed from it
            proc.programs = None if record.compiled else record.programs

    def close(self) -> None:
        if self.baseline is not None:
            self.last_baseline_steps.extend(self.baseline.steps)
            self.baseline.stop()
            self.baseline = None

