"""The few numbers two runs are compared by: step time, FLOPs, MFU, memory, padding waste.

One small model shared by `tpu-agent diff` and the tuner's report: a
profile.json is summarized here; a report.json carries its own `summary`
(the best verified configuration), so `diff` reads both the same way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError

from tpu_agent.errors import InputError, validation_line

SCHEMA_VERSION = 1


class Summary(BaseModel):
    schema_version: int = SCHEMA_VERSION
    kind: Literal["summary"] = "summary"
    source: str = Field(description="what it was taken from: profile | report")
    script: str | None = None
    device: str | None = Field(None, description="e.g. 'cpu (cpu) x1': runs on different devices compare poorly")
    step_time_s: float | None = Field(None, description="measured median step time")
    steps_measured: int | None = None
    flops_per_step: float | None = Field(None, description="XLA cost analysis (counted)")
    mfu: float | None = Field(None, description="achieved / peak FLOP/s")
    peak_memory_bytes: int | None = Field(None, description="XLA peak of the largest executable, per device")
    live_peak_bytes: int | None = Field(None, description="measured: most device bytes alive at a step boundary")
    step_peak_bytes: int | None = Field(None, description="measured: most device bytes alive inside a step")
    padding_waste: float | None = Field(None, description="estimate: share of dot/conv TPU work that is tile padding")
    padding_generation: str | None = None
    first_step_s: float | None = Field(None, description="measured: step 1's wall time, compiles included")
    warmup_overhead_s: float | None = Field(None, description="measured: the steps until compiling stopped, less "
                                            "as many steady steps")
    programs_compiled: int | None = Field(None, description="XLA compilations over the run")


def from_profile(profile) -> Summary:
    stats = profile.steps.stats
    device = None
    if profile.device is not None:
        device = f"{profile.device.platform} ({profile.device.device_kind}) x{profile.device.count}"
    return Summary(
        source="profile",
        script=Path(profile.script).name,
        device=device,
        step_time_s=stats.median_s if stats is not None else None,
        steps_measured=stats.count if stats is not None else None,
        flops_per_step=profile.flops.per_step if profile.flops is not None else None,
        mfu=profile.flops.mfu if profile.flops is not None else None,
        peak_memory_bytes=profile.memory.xla_peak_bytes,
        live_peak_bytes=profile.memory.live_peak_bytes,
        step_peak_bytes=profile.memory.step_peak_bytes,
        padding_waste=profile.padding.total_waste.value if profile.padding is not None else None,
        padding_generation=profile.padding.generation if profile.padding is not None else None,
        first_step_s=profile.warmup.first_step_s if profile.warmup is not None else None,
        warmup_overhead_s=profile.warmup.overhead_s if profile.warmup is not None else None,
        programs_compiled=profile.warmup.programs_compiled if profile.warmup is not None else None,
    )


def summarize(data: Any, *, name: str = "input") -> Summary:
    """A Summary from a parsed profile.json, report.json (its `summary`) or summary JSON; InputError if none of them."""
    from tpu_agent.profilers.schema import Profile

    if not isinstance(data, dict):
        raise InputError(f"{name}: expected a JSON object (a profile.json or report.json)")
    try:
        if isinstance(data.get("summary"), dict):  # report.json
            return Summary.model_validate({"source": "report", **data["summary"]})
        if data.get("kind") == "summary":
            return Summary.model_validate(data)
        if "steps" in data and "status" in data:
            return from_profile(Profile.model_validate(data))
    except ValidationError as exc:
        raise InputError(f"{name}: not a valid tpu-agent file: {validation_line(exc)}") from None
    raise InputError(f"{name}: not a tpu-agent profile.json or report.json (no 'steps' or 'summary')")


def load_summary(path: Path) -> Summary:
    path = Path(path)
    if path.is_dir():
        for candidate in ("report.json", "profile.json"):
            if (path / candidate).is_file():
                path = path / candidate
                break
        else:
            raise InputError(f"no profile.json or report.json in {path} (pass a run directory or one of those files)")
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise InputError(f"file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise InputError(f"{path}: not JSON ({exc})") from None
    return summarize(data, name=str(path))
