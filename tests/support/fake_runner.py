"""`Runner`'s interface with step times from a table instead of processes: ablation and fault tests in-process."""

from __future__ import annotations

import random

from tpu_agent.measure.runner import interleave
from tpu_agent.measure.trials import StepRecord
from tpu_agent.plan.actions import Plan, unit_of

# Step time factor of each unit of actions (plan.actions.unit_of) on a 10 ms baseline step; others: 1.
FACTORS = {"padding": 0.8, "execution": 0.9, "execution (numerics)": 0.9, "precision (numerics)": 1.2}


def step_time(plan: Plan, rng: random.Random, factors: dict[str, float] = FACTORS) -> float:
    t = 0.010
    for unit in {unit_of(a) for a in plan.actions}:
        t *= factors.get(unit, 1.0)
    return t * rng.uniform(0.98, 1.02)


class _Proc:
    def __init__(self, plan, rng, factors, compiling=0):
        self.plan, self.rng, self.factors, self.steps, self.notes = plan, rng, factors, [], []
        self.compiling = compiling  # its first steps compile, at 5x the time

    def step(self):
        late = len(self.steps) < self.compiling
        wall = step_time(self.plan, self.rng, self.factors) * (5 if late else 1)
        record = StepRecord(step=len(self.steps) + 1, wall_s=wall, loss=2.0, compiled=late)
        self.steps.append(record)
        return record


class FakeRunner:
    """Measures plans by FACTORS. `interrupt_at` (prefix, n): a Ctrl-C arrives after the first pair of the
    n-th measurement whose name starts with prefix ('trial', 'verify', 'ablate')."""

    def __init__(self, *args, interrupt_at: tuple[str, int] | None = None, factors: dict[str, float] = FACTORS,
                 compiling: int = 0, **kwargs):
        self.rng = random.Random(0)
        self.interrupt_at, self.factors, self.compiling = interrupt_at, factors, compiling
        self.verifications = 0
        self.baseline = None
        self.last_baseline_steps: list[StepRecord] = []
        self.script_failure = None
        self.measured: list[tuple[str, ...]] = []

    def _pairs(self, name, base, cand, pairs, report=None):
        self.measured.append((name, *sorted({unit_of(x) for x in cand.plan.actions})))
        if self.interrupt_at and name.startswith(self.interrupt_at[0]) and \
                sum(m[0].startswith(self.interrupt_at[0]) for m in self.measured) == self.interrupt_at[1]:
            base.step(), cand.step()
            raise KeyboardInterrupt
        return interleave(base.step, cand.step, pairs, report)

    def measure(self, plan, name, pairs, report=None, fresh_baseline=False):
        base, cand = _Proc(Plan(), self.rng, self.factors), _Proc(plan, self.rng, self.factors, self.compiling)
        a, b = self._pairs(name, base, cand, pairs, report)
        self.last_baseline_steps = base.steps
        return a, b, cand

    def measure_plans(self, without, plan, name, pairs=20):  # the default settings' verification: 20 pairs
        return self._pairs(name, _Proc(without, self.rng, self.factors), _Proc(plan, self.rng, self.factors), pairs)

    def close(self):
        pass
