"""The verdict on a plan: fresh processes, interleaved pairs, a confidence interval on the gain, the numerics check."""

from __future__ import annotations

from pydantic import BaseModel, Field

from tpu_agent.config import TuneOptions
from tpu_agent.measure.numerics import NumericsCheck, check_plan_numerics
from tpu_agent.measure.runner import Runner, batch_size, keeps_compiling, steady
from tpu_agent.measure.stats import MIN_PAIRS, MemoryEstimate, SpeedupEstimate, memory_saving, speedup
from tpu_agent.measure.trials import TrialFailed
from tpu_agent.plan.actions import Plan


class Attribution(BaseModel):
    """The gain one group of a verified plan's actions adds on top of the rest of the plan, measured."""

    group: str = Field(description="padding, execution, precision or sharding; with the effect when not exact, "
                       "e.g. 'padding (model)'")
    effect: str = Field("exact", description="what the unit does to the model: exact, numerics, model, training")
    actions: str = Field(description="the group's actions, as the report writes them")
    without: str = Field(description="the plan it was compared against: the verified plan minus the group")
    speed: SpeedupEstimate | None = Field(None, description="the full plan over the plan without the group")
    reason: str


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


def simulated_devices_only(plan: Plan) -> bool:
    """A mesh over simulated CPU devices: its time cannot be measured honestly here."""
    import jax

    return plan.mesh is not None and jax.default_backend() == "cpu"


def sharding_estimate(profile, plan: Plan, target: str) -> str | None:
    """A roofline guess of a sharded step on a TPU generation: labelled an estimate wherever it is shown.

    Per-device compute and memory traffic divide by the mesh size; a data-parallel
    step adds an all-reduce of the gradients (2 (n-1)/n of the parameter bytes)
    at HBM bandwidth, a lower bound on its cost over the interconnect.
    """
    from tpu_agent.backend.generations import GENERATIONS

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


def verify(plan: Plan, runner: Runner, options: TuneOptions, baseline_batch: int | None, profile=None) -> Verdict:
    """Fresh processes for both, interleaved pairs, CI on the speedup, the numerics check."""
    # Rounds of `steps` pairs, each in a fresh baseline and candidate process: the length a trial measured,
    # stopped the same way, as often as the verification's pairs need.
    rounds = options.verify_rounds
    runner.verifications += 1
    a, b, aligned = [], [], []
    for r in range(rounds):
        name = f"verify-{runner.verifications}" + (f"-{r + 1}" if rounds > 1 else "")
        try:
            ra, rb, cand = runner.measure(plan, name, options.steps, fresh_baseline=True)
        except TrialFailed as exc:
            return Verdict(plan=plan, accepted=False, reason=f"verification run failed: {exc.kind}: {exc.message[:200]}")
        finally:
            runner.close()
        a, b = a + ra, b + rb
        if not aligned:  # the losses of one round: every baseline and candidate process runs steps from step 1
            by_step: dict[int, float] = {}
            for s in runner.last_baseline_steps:
                if s.loss is not None:
                    by_step.setdefault(s.step, s.loss)
            aligned = [(by_step[s.step], s.loss) for s in cand.steps if s.loss is not None and s.step in by_step]
    numerics = None
    if aligned:
        numerics, plan = check_plan_numerics(plan, [x for x, _ in aligned], [y for _, y in aligned], options)
    cand_batch = batch_size(plan, baseline_batch)
    per_sample = baseline_batch is not None and cand_batch != baseline_batch
    steady_a, steady_b = steady(a, b, least=MIN_PAIRS)  # pairs in which a process compiled tell nothing steady
    speed = speedup([s.wall_s for s in steady_a], [s.wall_s for s in steady_b], min_gain=options.min_gain,
                    seed=options.seed,
                    baseline_batch=baseline_batch if per_sample else None,
                    candidate_batch=cand_batch if per_sample else None)
    memory = memory_saving([s.device_bytes for s in a], [s.device_bytes for s in b], min_gain=options.min_gain,
                           seed=options.seed) if all(s.device_bytes for s in a + b) else None
    estimate_note = None
    if simulated_devices_only(plan):
        estimate = sharding_estimate(profile, plan, options.target)
        estimate_note = ("time on simulated CPU devices is not a TPU's: the speed figure is measured here but "
                         "not claimed" + (f"; {estimate}" if estimate else ""))
    if len(steady_a) < len(a):  # said, so that a gain measured without the baseline's compiles is read as such
        speed = speed.model_copy(update={"reason": (
            f"{speed.reason}; {len(a) - len(steady_a)} of {len(a)} pairs left out: a process compiled in them")})
    if keeps_compiling(a):
        compiled = sum(s.compiled for s in a)
        speed = speed.model_copy(update={"reason": (
            f"{speed.reason}; compiles included: the baseline compiled new shapes in {compiled} of its {len(a)} "
            "measured steps, a cost that lasts while new lengths keep arriving (a long run that has seen every "
            "length stops paying it)")})
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
    return Verdict(plan=plan, accepted=bool(wanted and numerics_ok), reason=reason, speed=speed, memory=memory,
                   numerics=numerics, estimate_note=estimate_note)
