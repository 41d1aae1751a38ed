"""The record of a tune (tune.json, report.json): what the pipeline found, typed, stage by stage."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, PrivateAttr

from tpu_agent.config import TuneOptions
from tpu_agent.paths import write_atomic
from tpu_agent.parallelism.measured import MeasuredParallelism
from tpu_agent.projection.rank import SliceRanking
from tpu_agent.propose.base import Candidate
from tpu_agent.report.summary import Summary, from_profile
from tpu_agent.search.records import TrialRecord
from tpu_agent.verify.verdict import Verdict


def cpu_model() -> str:
    """This host's CPU model (`/proc/cpuinfo`'s model name on Linux), else what the platform module says."""
    import platform

    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def measured_on(profile) -> str:
    """Where a tune's gains are measured, in one phrase: the host's CPU model and core count, the JAX platform the
    device ran on and its device count (`AMD EPYC 7B13 (2 cores), JAX platform cpu, 1 device`)."""
    import os

    device = getattr(profile, "device", None)
    env = getattr(profile, "environment", None)
    platform = device.platform if device is not None else (env.jax_default_backend if env is not None else None)
    count = device.count if device is not None else (len(env.jax_devices) if env is not None else None)
    cores = (env.cpu_count if env is not None else None) or os.cpu_count()
    devices = "" if count is None else f", {count} device{'s' if count != 1 else ''}"
    simulated = " (simulated on the CPU)" if platform == "cpu" and (count or 1) > 1 else ""
    dist = getattr(profile, "distributed", None)
    ranks = f" in each of {dist.world_size} processes (ranks)" if dist is not None and dist.world_size > 1 else ""
    return f"{cpu_model()} ({cores} cores), JAX platform {platform or 'unknown'}{devices}{ranks}{simulated}"


def target_split(result: "TuneResult") -> str | None:
    """With --target naming a TPU generation (or slice) while this host is not a TPU: the line that separates what
    this host measured from what is only estimated for the target; None otherwise."""
    if result.settings.target == "cpu" or (result.host or "").find("JAX platform tpu") >= 0:
        return None
    target = result.settings.slice or result.settings.target  # `2xv5e-4` with --slices 2
    return (f"what this host measured (times, intervals, verified changes) is this host's; figures for "
            f"{target} (rooflines, projections, padding waste) are estimates, never verified here, and a change "
            f"whose benefit is only {target}'s is not called verified")


class TuneResult(BaseModel):
    script: str
    args: list[str]
    settings: TuneOptions
    study: str
    storage: str
    run_dir: str
    baseline_profile: str | None = None
    host: str | None = Field(None, description="where the gains were measured: host CPU model and cores, JAX "
                             "platform, device count (result.measured_on)")
    baseline_mode: str | None = Field(None, description="how the unchanged script executed: eager, fused, compiled")
    plan_profile: str | None = Field(None, description="the verified plan's profile.json (the summary's figures)")
    parameters: list[int | None] = Field(default_factory=lambda: [None, None], description=(
        "measured: parameter elements the optimizers update, baseline and verified plan (None: not measured)"))
    proposer: str = "offline"
    proposer_notes: list[str] = Field(default_factory=list)
    candidates: list[Candidate] = Field(default_factory=list)
    left_out: list[str] = Field(default_factory=list, description="knobs and candidates out of the search's classes, why")
    script_failure: str | None = Field(None, description="the unchanged script's own failure after its steps (a "
                                       "checkpoint reload at its end, say): the steps before it were measured")
    trials: list[TrialRecord] = Field(default_factory=list)
    verdicts: list[Verdict] = Field(default_factory=list)
    best: Verdict | None = None
    projection: SliceRanking | None = Field(None, description="--target SLICE: plans for the slice ranked by "
                                            "projection (estimates, never verified)")
    parallelism: MeasuredParallelism | None = Field(None, description="--nproc N: the parallelism plans measured, "
                                                     "memory per rank each; with --target, ranked by projection")
    phase: Literal["starting", "baseline", "projection", "search", "verification", "ablation", "profile",
                   "done"] = Field("starting", description="the phase running when tune.json was last written "
                                   "(tests and watchers wait on it)")
    interrupted: bool = False
    interrupted_during: Literal["baseline", "projection", "search", "verification", "ablation", "profile"] | None = None
    interrupted_by: Literal["SIGINT", "SIGTERM", "SIGHUP"] | None = Field(
        None, description="what stopped it: Ctrl-C (SIGINT), SIGTERM or SIGHUP; the exit code is 128 + its number")
    duration_s: float = 0.0
    phase_s: dict[str, float] = Field(default_factory=dict, description="measured: seconds spent in each phase "
                                      "(baseline, search, verification, ablation, profile), where the tune's time went")
    summary: Summary | None = Field(None, description="for `tpu-agent diff`: the step time after the verified change")

    _phase_began: float = PrivateAttr(0.0)
    _saved: bool = PrivateAttr(False)

    def mark_interrupted(self, signum: int | None) -> None:
        """Interrupted in the phase running now, by the stop signal `signum` (None: Ctrl-C)."""
        self.interrupted, self.interrupted_during = True, self.phase
        self.interrupted_by = {None: "SIGINT", 1: "SIGHUP", 15: "SIGTERM"}.get(signum, "SIGINT")

    def save(self, t_start: float) -> "TuneResult":
        """Write tune.json whole or not at all (a reader never sees half a file)."""
        self.duration_s = time.perf_counter() - t_start
        # the first record is written before any work: a folder that refuses it is bad input (exit 2)
        write_atomic(Path(self.run_dir) / "tune.json", self.model_dump_json(indent=2) + "\n", "the tune's record",
                     before_work=not self._saved)
        self._saved = True
        return self

    def enter(self, phase: str, t_start: float) -> None:
        """Record the phase that starts now, in tune.json, before its work begins; the time since the last phase
        began goes to that phase."""
        self._charge(t_start)
        self.phase = phase
        self.save(t_start)

    def _charge(self, t_start: float) -> None:
        now = time.perf_counter() - t_start
        if self.phase not in ("starting", "done"):
            self.phase_s[self.phase] = round(self.phase_s.get(self.phase, 0.0) + now - self._phase_began, 3)
        self._phase_began = now


def summary_of(profile, verdict: Verdict | None, plan_profile=None) -> Summary:
    """The baseline's figures; with a verified change, the profile of the verified plan (every figure measured),
    or without one, its verified step time (the other figures unknown)."""
    if verdict is not None and plan_profile is not None:
        return from_profile(plan_profile).model_copy(update={"source": "report"})
    summary = from_profile(profile).model_copy(update={"source": "report"})
    if verdict is not None and verdict.speed and not verdict.speed.per_sample:
        summary = summary.model_copy(update={
            "step_time_s": verdict.speed.candidate_median_s, "steps_measured": verdict.speed.pairs,
            "flops_per_step": None, "mfu": None, "peak_memory_bytes": None,
            # device bytes measured with the change in its verification: a memory gate can compare them
            "live_peak_bytes": round(verdict.memory.candidate_median_bytes) if verdict.memory else None,
            "padding_waste": None})
    return summary
