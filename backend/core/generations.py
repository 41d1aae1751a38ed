"""TPU generations the device can pretend to be; the profiler's peak tables read this.

Figures are per chip, from Google Cloud's TPU system-architecture pages
(cloud.google.com/tpu/docs/v4, v5e, v5p, v6e, tpu7x) as carried by torch-tpu 0.2.0.
"""

from __future__ import annotations

from dataclasses import dataclass

from tpu_agent import envvars

GiB = 1 << 30


@dataclass(frozen=True)
class Generation:
    name: str
    peak_bf16_flops: float  # FLOP/s
    hbm_bytes: int
    hbm_bandwidth: float  # bytes/s
    mxu: int  # systolic array edge
    source: str = ""  # where the figures come from


_DOCS = "https://cloud.google.com/tpu/docs/"

GENERATIONS = {
    "v4": Generation("v4", 275e12, 32 * GiB, 1.2e12, 128, _DOCS + "v4"),
    "v5e": Generation("v5e", 197e12, 16 * GiB, 0.819e12, 128, _DOCS + "v5e"),
    "v5p": Generation("v5p", 459e12, 95 * GiB, 2.765e12, 128, _DOCS + "v5p"),
    "v6e": Generation("v6e", 918e12, 32 * GiB, 1.64e12, 256, _DOCS + "v6e"),
    "v7x": Generation("v7x", 2307e12, 192 * GiB, 7.37e12, 256, _DOCS + "tpu7x"),
}
DEFAULT_GENERATION = envvars.GENERATION.default


def current_generation() -> Generation:
    """The generation set by `TPU_AGENT_GENERATION` (default v5e)."""
    name = envvars.GENERATION.value.lower()
    if name == "v7":
        name = "v7x"
    if name not in GENERATIONS:
        known = ", ".join(GENERATIONS)
        raise ValueError(f"TPU_AGENT_GENERATION={name!r} is not one of {known}")
    return GENERATIONS[name]
