"""Which plan a trial measures: never one the study already holds (measured, running on another worker, or
queued). A space small enough to measure whole is enumerated, every plan once in a seeded random order; a larger
one is sampled by TPE, whose proposals of plans already taken are drawn again. Enqueued trials (the proposers'
seeds, a dead worker's retry) keep their own picks."""

from __future__ import annotations

import itertools
import math
import random

import optuna

from tpu_agent.config import TuneOptions
from tpu_agent.plan.actions import Plan
from tpu_agent.search.space import OFF, Space

ENUMERATE_MAX = 20_000  # pick combinations listed one by one; past it, only TPE and random draws
TPE_DRAWS = 30  # TPE proposals tried before a random plan not yet taken


def distribution(space: Space, cid: str) -> optuna.distributions.CategoricalDistribution:
    return optuna.distributions.CategoricalDistribution([OFF] + [str(i) for i in range(len(space.options[cid]))])


def plan_for(space: Space, picks: dict[str, str]) -> Plan:
    """The plan a trial's picks make: each picked option's actions (ValueError: an invalid combination)."""
    actions = []
    for cand in space.candidates:
        pick = picks.get(cand.id, OFF)
        if pick != OFF:
            actions.extend(space.options[cand.id][int(pick)])
    return Plan(actions=actions)


def invalid_for_devices(plan: Plan, options: TuneOptions) -> str | None:
    """Why a plan's mesh cannot run on --devices (None: it can)."""
    mesh = plan.mesh
    if mesh is None or mesh.devices <= options.devices:
        return None
    return f"invalid combination: mesh {dict(mesh.axes)} needs {mesh.devices} devices, {options.devices} available"


def plan_key(space: Space, picks: dict[str, str], options: TuneOptions | None = None) -> str | None:
    """The plan a set of picks makes, as its key; None for no change at all or an invalid combination."""
    try:
        plan = plan_for(space, picks)
    except ValueError:
        return None
    if not plan.actions or (options is not None and invalid_for_devices(plan, options)):
        return None
    return plan.key()


class Plans:
    """The distinct plans of a space (when it is small enough to list): their picks, by plan key."""

    def __init__(self, space: Space, options) -> None:
        self.space, self.options = space, options
        sizes = [len(space.options[c.id]) + 1 for c in space.candidates]
        self.combinations = math.prod(sizes) if sizes else 0
        self.by_key: dict[str, dict[str, str]] | None = None
        if self.combinations <= ENUMERATE_MAX:
            self.by_key = {}
            ids = [c.id for c in space.candidates]
            for combo in itertools.product(*[[OFF] + [str(i) for i in range(n - 1)] for n in sizes]):
                picks = dict(zip(ids, combo))
                key = plan_key(space, picks, options)
                if key is not None:
                    self.by_key.setdefault(key, picks)

    @property
    def count(self) -> int | None:
        return len(self.by_key) if self.by_key is not None else None

    def describe(self, budget: int) -> str:
        """The sampling strategy in one line, as the output says it."""
        if self.count is not None and self.count <= budget:
            return (f"sampler: every plan once (the space has {self.count} plans, {budget} trials asked"
                    + (f": {self.count} trials" if self.count < budget else "") + ")")
        many = f"{self.count} plans" if self.count is not None else f"{self.combinations} combinations"
        return f"sampler: TPE over {many}, a plan already measured never proposed again"

    def enumerates(self, budget: int) -> bool:
        return self.count is not None and self.count <= budget


def taken(study: optuna.Study, space: Space, but: int | None = None) -> set[str]:
    """The plans of every trial in the study (any state: measured, running elsewhere, queued, failed)."""
    keys = set()
    for t in study.get_trials(deepcopy=False):
        if t.number == but:
            continue
        key = t.user_attrs.get("plan_key")  # the plan it measured: its picks may read otherwise in this space
        if key is None:  # queued or just started: its picks, in this space
            picks = t.params or t.system_attrs.get("fixed_params") or {}
            key = plan_key(space, picks) if picks else None
        if key is not None:
            keys.add(key)
    return keys


class PlanSampler(optuna.samplers.BaseSampler):
    """Chooses a trial's picks before it starts (before_trial): an untaken plan, by enumeration or by TPE."""

    def __init__(self, space: Space, plans: Plans, budget: int, seed: int) -> None:
        self.space, self.plans, self.budget = space, plans, budget
        self.tpe = optuna.samplers.TPESampler(seed=seed)
        self.seed = seed
        self.chosen: dict[str, str] = {}

    def infer_relative_search_space(self, study, trial):
        return {}

    def sample_relative(self, study, trial, search_space):
        return {}

    def sample_independent(self, study, trial, param_name, param_distribution):
        if param_name in self.chosen:
            return self.chosen[param_name]
        return self.tpe.sample_independent(study, trial, param_name, param_distribution)

    def before_trial(self, study, trial) -> None:
        self.chosen = {}
        if trial.params or "fixed_params" in trial.system_attrs:  # enqueued: a seed or a retry
            return
        self.chosen = self.choose(study, trial) or {}

    def after_trial(self, study, trial, state, values) -> None:
        self.tpe.after_trial(study, trial, state, values)

    def untaken(self, study: optuna.Study) -> int | None:
        """How many plans are left to measure (None: too many to count)."""
        if self.plans.by_key is None:
            return None
        return len(set(self.plans.by_key) - taken(study, self.space))

    def choose(self, study: optuna.Study, trial) -> dict[str, str] | None:
        done = taken(study, self.space, but=trial.number)
        rng = random.Random(f"{self.seed}-{trial.number}")  # workers choosing at once mostly choose apart
        if not self.plans.enumerates(self.budget):
            for _ in range(TPE_DRAWS):
                picks = {c.id: self.tpe.sample_independent(study, trial, c.id, distribution(self.space, c.id))
                         for c in self.space.candidates}
                key = plan_key(self.space, picks, self.plans.options)
                if key is not None and key not in done:
                    return picks
        if self.plans.by_key is not None:
            left = sorted(k for k in self.plans.by_key if k not in done)
            return dict(self.plans.by_key[rng.choice(left)]) if left else None
        for _ in range(1000):  # too many to list: random picks until one is new
            picks = {c.id: rng.choice(distribution(self.space, c.id).choices) for c in self.space.candidates}
            key = plan_key(self.space, picks, self.plans.options)
            if key is not None and key not in done:
                return picks
        return None


def seeds(space: Space, plans: Plans, budget: int) -> list[dict[str, str]]:
    """The proposers' own proposals, queued first (enqueue_trial): every candidate's first option together (the
    plan they propose), then each alone in rank order; at most half the budget, each plan once."""
    out, keys = [], set()
    ranked = sorted(space.candidates, key=lambda c: c.rank or 10**6)
    off = {c.id: OFF for c in space.candidates}  # every pick fixed: the sampler adds nothing to a seed
    wishes = [off | {c.id: "0" for c in ranked}] + [off | {c.id: "0"} for c in ranked]
    for picks in wishes:
        key = plan_key(space, picks, plans.options)
        if key is not None and key not in keys:
            keys.add(key)
            out.append(picks)
    return out[:max(1, budget // 2)]
