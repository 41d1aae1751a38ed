"""What the machine looks like: shown by `doctor`, recorded in every profile.

Each probe is guarded: a broken torch or jax install is exactly what `doctor`
must be able to report, so a failing probe becomes a problem line, not a crash.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import sys
from pathlib import Path

from tpu_agent import __version__, envvars
from tpu_agent.errors import one_line
from tpu_agent.paths import cache_dir, runs_dir
from tpu_agent.profilers.environment import Environment, JaxDevice

__all__ = ["Environment", "JaxDevice", "collect_environment"]


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _import_problem(name: str, exc: BaseException) -> str:
    if isinstance(exc, ModuleNotFoundError) and exc.name == name:
        return f"{name} is not installed"
    return f"import {name} failed: {one_line(exc, causes=True)}"


def _probe_torch(problems: list[str]) -> tuple[str | None, bool | None]:
    try:
        import torch  # runs the `torch.backends` entry points, our device included
    except Exception as exc:  # noqa: BLE001 - any import failure is a finding
        problems.append(_import_problem("torch", exc))
        return _dist_version("torch"), None
    return torch.__version__, torch._C._get_privateuse1_backend_name() == "tpu"


def _probe_jax(problems: list[str]) -> tuple[str | None, list[JaxDevice]]:
    try:
        import jax
    except Exception as exc:  # noqa: BLE001
        problems.append(_import_problem("jax", exc))
        return None, []
    try:
        backend = jax.default_backend()
        devices = [
            JaxDevice(
                id=d.id,
                platform=d.platform,
                device_kind=d.device_kind,
                process_index=d.process_index,
            )
            for d in jax.devices()
        ]
    except Exception as exc:  # noqa: BLE001
        problems.append(f"jax could not list devices: {one_line(exc, causes=True)}")
        return None, []
    return backend, devices


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _probe_peak(problems: list[str], calibrate: bool) -> tuple[float | None, str | None]:
    """The MFU peak: read from the calibration cache, measured now only when asked."""
    try:
        from tpu_agent.profilers.peaks import current_peak

        peak = current_peak(measure=calibrate)
    except Exception as exc:  # noqa: BLE001
        problems.append(f"could not read the peak FLOP/s: {one_line(exc, causes=True)}")
        return None, None
    return (peak.flops_per_s, peak.source) if peak is not None else (None, None)


def collect_environment(cwd: Path | None = None, calibrate: bool = False) -> Environment:
    """Probe the interpreter, torch, jax and the settings tpu-agent depends on."""
    problems: list[str] = []
    torch_version, torch_tpu_device = _probe_torch(problems)
    jax_backend, jax_devices = _probe_jax(problems)
    peak, peak_source = _probe_peak(problems, calibrate) if jax_devices else (None, None)
    return Environment(
        tpu_agent_version=__version__,
        python_version=platform.python_version(),
        python_executable=sys.executable,
        os=platform.platform(),
        machine=platform.machine(),
        cpu_count=os.cpu_count(),
        torch_version=torch_version,
        torch_tpu_device=torch_tpu_device,
        jax_version=_dist_version("jax"),
        jaxlib_version=_dist_version("jaxlib"),
        jax_default_backend=jax_backend,
        jax_devices=jax_devices,
        torch_tpu_importable=_importable("torch_tpu"),
        anthropic_api_key_set=bool(envvars.ANTHROPIC_API_KEY.get()),
        cache_dir=str(cache_dir()),
        runs_dir=str(runs_dir(cwd)),
        peak_flops_per_s=peak,
        peak_source=peak_source,
        problems=problems,
    )
