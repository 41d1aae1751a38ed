"""A search in process, its step times and losses from a table (no processes): the study it records is what
tests of the study's contents read (constraints, attributes, pruners, optuna-dashboard)."""

from __future__ import annotations

import random
import warnings
from pathlib import Path

from tpu_agent.config import TuneOptions
from tpu_agent.measure.context import Measuring
from tpu_agent.measure.runner import interleave
from tpu_agent.measure.trials import StepRecord, TrialFailed
from tpu_agent.propose.candidates import ActionTemplate, Candidate
from tpu_agent.search.space import Space
from tpu_agent.search.loop import search
from tpu_agent.search.study import open_study

# Step time of a plan (baseline 10 ms) by its one action; a loss factor (1.0: the baseline's losses).
FAST, SLOW, ROUNDS, OOM, SOMEWHAT, COMPILES = "fused", "eager", "default", "pad8", "pad16", "pad32"
TIME = {FAST: 0.008, SLOW: 0.013, ROUNDS: 0.007, SOMEWHAT: 0.0092, COMPILES: 0.008}
COMPILING = {COMPILES: 5}  # its first 5 timed steps compile, at 5x the steady time
LOSS = {ROUNDS: 1.10}  # one bf16 pass: 10 % worse losses, beyond --loss-tol 2 %


def which(plan) -> str:
    (action,) = plan.actions
    return getattr(action, "mode", None) or getattr(action, "precision", None) or f"pad{action.multiple}"


class Proc:
    def __init__(self, name: str | None, rng: random.Random):
        self.name, self.rng, self.steps, self.notes = name, rng, [], []

    def step(self) -> StepRecord:
        t = (TIME[self.name] if self.name else 0.010) * self.rng.uniform(0.97, 1.03)
        compiled = len(self.steps) < COMPILING.get(self.name, 0)
        record = StepRecord(step=len(self.steps) + 1, wall_s=t * (5 if compiled else 1), compiled=compiled,
                            loss=2.0 / len(self.steps + [0]) * LOSS.get(self.name, 1.0), device_bytes=1000)
        self.steps.append(record)
        return record


class TableRunner:
    """Runner's interface: a baseline and a candidate stepped in turns, their times from TIME."""

    baseline = None

    def __init__(self):
        self.rng, self.measured = random.Random(0), []

    def measure(self, plan, name, pairs, report=None, fresh_baseline=False):
        self.measured.append(which(plan))
        if which(plan) == OOM:
            raise TrialFailed("out_of_memory", "RESOURCE_EXHAUSTED: out of memory allocating 1 TiB")
        cand = Proc(which(plan), self.rng)
        a, b = interleave(Proc(None, self.rng).step, cand.step, pairs, report)
        return a, b, cand


def space(*names: str) -> Space:
    templates = {FAST: ActionTemplate(kind="compile", fixed={"mode": "fused"}),
                 SLOW: ActionTemplate(kind="compile", fixed={"mode": "eager"}),
                 ROUNDS: ActionTemplate(kind="matmul_precision", fixed={"precision": "default"}),
                 OOM: ActionTemplate(kind="pad_ops", fixed={"multiple": 8}),
                 SOMEWHAT: ActionTemplate(kind="pad_ops", fixed={"multiple": 16}),
                 COMPILES: ActionTemplate(kind="pad_ops", fixed={"multiple": 32})}
    cands = [Candidate(id=n, title=n, proposer="offline", rank=i + 1, preserves_numerics=True, actions=[templates[n]])
             for i, n in enumerate(names)]
    return Space(candidates=cands, options={c.id: c.options() for c in cands})


def run(tmp_path: Path, sp: Space, order: list[str], pruner: str = "median"):
    """Trials in the given order (each turns one candidate on), under `pruner`: a plan given twice is queued twice
    (a repeat runs, recorded without measuring) and counts once against --trials. The proposers' seeds (their
    whole proposal first) stay out: the order is the test's, and the table times one action per plan."""
    options = TuneOptions(trials=len(set(order)), steps=8, storage=f"sqlite:///{tmp_path / 'studies.db'}")
    study = open_study(options, f"s-{pruner}", "fp", tmp_path, pruner=pruner, about={"script": "train.py"})
    for on in order:
        study.enqueue_trial({c.id: ("0" if c.id == on else "off") for c in sp.candidates})
    runner = TableRunner()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing of Optuna's reaches the user's terminal
        records = search(study, sp, Measuring(runner, options), seeded=False)  # the order above, no seeds of its own
    return study, records, runner
