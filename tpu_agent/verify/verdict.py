"""The verdict on a plan: fresh processes, interleaved pairs, a confidence interval on the gain, the numerics check."""

from __future__ import annotations

from pydantic import BaseModel, Field, computed_field

from tpu_agent.config import TuneOptions
from tpu_agent.measure.compare import aligned_losses, losses_by_step, rank_memory, rank_memory_line
from tpu_agent.measure.context import Measuring
from tpu_agent.measure.numerics import NumericsCheck
from tpu_agent.measure.runner import steady_enough
from tpu_agent.measure.stats import MemoryEstimate, SpeedupEstimate
from tpu_agent.measure.trials import TrialFailed
from tpu_agent.plan.action_base import Effect, Group
from tpu_agent.plan.actions import Plan


class Attribution(BaseModel):
    """The gain one unit of a verified plan's actions (a group, split by effect) adds on top of the rest of the
    plan, measured."""

    group: Group = Field(description="padding, execution, precision or sharding")
    effect: Effect = Field("exact", description="what the unit does to the model: exact, numerics, model, training")
    actions: str = Field(description="the group's actions, as the report writes them")
    without: str = Field(description="the plan it was compared against: the verified plan minus the group")
    speed: SpeedupEstimate | None = Field(None, description="the full plan over the plan without the group")
    reason: str
    no_change: bool = Field(False, description="the plan ran the same programs without the group: never measured")

    @computed_field
    @property
    def unit(self) -> str:
        """The group, with the effect when not exact (`padding (model)`): the ablation's unit (Plan.units)."""
        return self.group if self.effect == "exact" else f"{self.group} ({self.effect})"


class Verdict(BaseModel):
    """Whether a plan's gain is verified, with the numbers that decided it."""

    plan: Plan
    accepted: bool
    reason: str
    speed: SpeedupEstimate | None = None
    memory: MemoryEstimate | None = None
    numerics: NumericsCheck | None = None
    estimate_note: str | None = Field(None, description="a time gain that can only be estimated here (sharding on a CPU host)")
    attribution: list[Attribution] = Field(default_factory=list, description="what each group of actions adds")
    left_out: list[str] = Field(default_factory=list, description="units the ablation left out of the plan, and why")
    rank_memory: list[tuple[int, int]] | None = Field(
        None, description="an N-rank job: each rank's (baseline, plan) peak device bytes, medians over the pairs")


def simulated_devices_only(plan: Plan) -> bool:
    """A mesh over simulated CPU devices: its time cannot be measured honestly here. JAX is imported only for a plan
    with a mesh: the tune's own process needs it for nothing else (about 0.8 s of CPU per verification)."""
    if plan.mesh is None:
        return False
    import jax

    return jax.default_backend() == "cpu"


def sharding_estimate(profile, plan: Plan, target: str) -> str | None:
    """A roofline guess of a sharded step on a TPU generation: labelled an estimate wherever it is shown.

    Per-device compute and memory traffic divide by the mesh size; a data-parallel
    step adds an all-reduce of the gradients (2 (n-1)/n of the parameter bytes)
    at HBM bandwidth, a lower bound on its cost over the interconnect.
    """
    from tpu_agent.backend.core.generations import GENERATIONS

    mesh = plan.mesh
    if mesh is None or profile is None or profile.flops is None:
        return None
    gen = GENERATIONS.get(target if target != "cpu" else "v5e")
    flops, traffic = profile.flops.per_step, profile.flops.bytes_per_step
    n = mesh.devices
    single = max(flops / gen.peak_bf16_flops, traffic / gen.hbm_bandwidth)
    live = profile.memory.live_peak_bytes or 0
    allreduce = 2 * (n - 1) / n * live / 4 / gen.hbm_bandwidth  # a quarter of live bytes as gradients: rough
    sharded = single / n + allreduce
    return (f"estimate (roofline, TPU {gen.name}): {single * 1e3:.3f} ms per step on one chip, "
            f"{sharded * 1e3:.3f} ms over {n} chips ({single / sharded:.2f}x); not measured")


def resharded_on_cpu_ranks(plan: Plan, options: TuneOptions) -> bool:
    """Another sharding of an N-rank job (its mesh, its resharding) run by ranks on this CPU: the time of their
    collectives over gloo says nothing of a TPU slice's interconnect."""
    if options.nproc <= 1 or not any(a.group == "sharding" for a in plan.actions):
        return False
    import jax

    return jax.default_backend() == "cpu"


def verify(plan: Plan, measuring: Measuring) -> Verdict:
    """Fresh processes for both, interleaved pairs, CI on the speedup, the numerics check."""
    runner, options = measuring.runner, measuring.options
    estimate_note = None  # what cannot be claimed, whatever is measured
    if resharded_on_cpu_ranks(plan, options):
        estimate_note = (f"the sharding of {options.nproc} ranks on this CPU host is not a TPU slice's: its time is "
                         "measured here but not claimed (--target SLICE ranks meshes by projection)")
    elif simulated_devices_only(plan):
        estimate = sharding_estimate(measuring.profile, plan, options.generation)
        estimate_note = ("time on simulated CPU devices is not a TPU's: the speed figure is measured here but "
                         "not claimed" + (f"; {estimate}" if estimate else ""))
    # Rounds of `round_pairs` pairs, each in a fresh baseline and candidate process (--processes of them at
    # least): the interval counts the spread between process pairs, not only the steps inside one.
    rounds = options.verify_rounds
    runner.verifications += 1
    a, b, losses = [], [], []
    for r in range(rounds):
        name = f"verify-{runner.verifications}" + (f"-{r + 1}" if rounds > 1 else "")
        try:
            ra, rb, cand = runner.measure(plan, name, options.steps, report=steady_enough(options.round_pairs),
                                          fresh_baseline=True)
        except TrialFailed as exc:
            if exc.kind == "no_change":  # never verified, never kept
                return Verdict(plan=plan, accepted=False, reason=exc.message)
            return Verdict(plan=plan, accepted=False, reason=f"verification run failed: {exc.kind}: {exc.message[:200]}")
        finally:
            runner.close()
        a, b = a + ra, b + rb
        if not losses:  # the losses of one round: every baseline and candidate process runs steps from step 1
            losses = aligned_losses(losses_by_step(runner.last_baseline_steps), cand.steps)
    compared = measuring.compare(a, b, plan, losses=losses)
    numerics, plan = compared.numerics()
    speed, memory = compared.speedup(), compared.memory()
    notes = compared.compiling_notes()  # said, so that a gain measured without compiles (or with them) reads so
    if notes:
        speed = speed.model_copy(update={"reason": "; ".join([speed.reason, *notes])})
    time_ok = speed.accepted and estimate_note is None
    memory_ok = memory is not None and memory.accepted
    wanted = {"time": time_ok, "memory": memory_ok, "both": time_ok or memory_ok}[options.objective]
    numerics_ok = numerics is None or numerics.passed
    if not numerics_ok:
        reason = f"numerics: {numerics.reason}"
    elif wanted:
        parts = []
        if time_ok:
            parts.append(speed.reason)
        if memory_ok and options.objective != "time":
            parts.append(memory.reason)
        reason = "; ".join(parts)
    else:
        reason = speed.reason if options.objective == "time" else (
            memory.reason if memory is not None else "no device memory figures")
        if estimate_note and options.objective == "time":
            reason = estimate_note
    ranks = rank_memory_line(a, b)
    if ranks is not None:  # an N-rank job: what the plan does to each rank's memory, whatever the verdict
        reason = f"{reason}; {len(rank_memory(b))} ranks, each step timed as its slowest rank's; {ranks}"
    return Verdict(plan=plan, accepted=bool(wanted and numerics_ok), reason=reason, speed=speed, memory=memory,
                   numerics=numerics, estimate_note=estimate_note,
                   rank_memory=list(zip(rank_memory(a), rank_memory(b))) if ranks is not None else None)
