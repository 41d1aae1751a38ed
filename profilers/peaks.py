"""The peak FLOP/s an MFU is measured against.

A TPU's peak is its datasheet figure (the generation table). A CPU or GPU
running the bundled device has no such figure worth trusting, so it is
measured once by a matmul calibration and cached in the user's cache
directory, keyed by the machine and the JAX version.
"""

from __future__ import annotations

import json
import os
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

from tpu_agent.backend.core.generations import GENERATIONS, Generation
from tpu_agent.envvars import cache_dir  # the one rule; the calibrations live there

from .schema import Peak

CACHE_FILE = "peaks.json"
SIZES = (1024, 2048)
REPEATS = 5


def tpu_generation(device_kind: str) -> Generation | None:
    """The generation of a real TPU from JAX's device_kind ("TPU v5 lite", "TPU v6e", "TPU7x"...)."""
    kind = device_kind.lower().replace(" ", "")
    for needle, name in (("v5lite", "v5e"), ("v5e", "v5e"), ("v6lite", "v6e"), ("v6e", "v6e"),
                         ("tpu7", "v7x"), ("v7", "v7x"), ("v5p", "v5p"), ("v5", "v5p"), ("v4", "v4")):
        if needle in kind:
            return GENERATIONS[name]
    return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_key(platform_name: str, device_kind: str, device_count: int) -> str:
    import jax

    return f"{platform_name}|{device_kind}|{_cpu_model()}|{os.cpu_count()} cpus|jax {jax.__version__}|{device_count} devices"


def _cache_path() -> Path:
    return cache_dir() / CACHE_FILE


def _read_cache() -> dict:
    try:
        data = json.loads(_cache_path().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def cached(key: str) -> dict | None:
    entry = _read_cache().get(key)
    return entry if isinstance(entry, dict) and isinstance(entry.get("flops_per_s"), (int, float)) else None


def _store(key: str, entry: dict) -> str | None:
    """Write the cache; return a note if it could not be written (the figure is still used)."""
    path = _cache_path()
    data = _read_cache()
    data[key] = entry
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        tmp.replace(path)
    except OSError as exc:
        return f"could not cache the calibration in {path}: {exc.strerror or exc}"
    return None


def calibrate() -> float:
    """Best f32 matmul FLOP/s on JAX's default device, over a few sizes and repeats."""
    import jax
    import jax.numpy as jnp

    best = 0.0
    matmul = jax.jit(lambda a, b: a @ b)
    for n in SIZES:
        a = jnp.ones((n, n), jnp.float32)
        matmul(a, a).block_until_ready()
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            matmul(a, a).block_until_ready()
            best = max(best, 2.0 * n**3 / (time.perf_counter() - t0))
    return best


def _calibration_peak(entry: dict, path: Path) -> Peak:
    return Peak(
        flops_per_s=float(entry["flops_per_s"]), dtype="float32", measured=True,
        source=f"measured: best f32 matmul ({'/'.join(f'{n}^3' for n in SIZES)}) on this machine, "
               f"{entry.get('measured_at', '?')}, cached in {path}",
    )


def device_peak(platform_name: str, device_kind: str, device_count: int, *, measure: bool = True,
                notes: list[str] | None = None) -> Peak | None:
    """The peak for MFU: a TPU's datasheet bf16 figure, else the cached (or now measured) calibration."""
    if platform_name == "tpu":
        gen = tpu_generation(device_kind)
        if gen is None:
            if notes is not None:
                notes.append(f"unknown TPU kind {device_kind!r}: no peak, no MFU")
            return None
        return Peak(flops_per_s=gen.peak_bf16_flops, dtype="bfloat16", measured=False,
                    source=f"datasheet: TPU {gen.name} peak bf16 per chip ({gen.source})")
    key = machine_key(platform_name, device_kind, device_count)
    entry = cached(key)
    if entry is None:
        if not measure:
            return None
        entry = {"flops_per_s": calibrate(), "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                 "key": key}
        problem = _store(key, entry)
        if problem and notes is not None:
            notes.append(problem)
    return _calibration_peak(entry, _cache_path())


def current_peak(measure: bool = False) -> Peak | None:
    """The peak of this process's default JAX device (doctor uses it, measure=False: cache only)."""
    import jax

    devices = jax.devices()
    return device_peak(devices[0].platform, devices[0].device_kind, len(devices), measure=measure)
