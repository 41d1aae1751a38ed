"""JAX configuration, applied before JAX first initialises its backends.

- 64-bit types on, so int64 and float64 keep PyTorch's semantics. Process-wide: JAX code of the user's own in
  the same process sees 64-bit defaults too. JAX's `jax.enable_x64(True)` context would scope it, but it is
  thread-local and only holds while entered: an int64 array made inside stays int64, yet any JAX op run on it
  outside the context gives int32 (with a warning). Scoping therefore means entering it wherever the device
  calls JAX (each op, the device's kernels, fused flushes from synchronize/mark_step/hooks, compiled steps and
  module programs, transfers, collectives, sharding placement, the profiler's cost analysis); one missed
  entry silently truncates int64 values.
- `TPU_AGENT_DEVICES=N` simulates N devices on a CPU host (XLA's
  `--xla_force_host_platform_device_count`), for sharding on one machine.
- XLA's persistent compilation cache, on by default: every process (each tune
  trial, each run of a script) otherwise compiles the same op programs again,
  and on a CPU that costs more than the ops. `TPU_AGENT_XLA_CACHE=DIR` moves it,
  `off` turns it off.
- A rank of a torchrun job (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) joins the job's JAX runtime
  (distributed/runtime.py); where a host runs several ranks (LOCAL_WORLD_SIZE), each opens only its own share
  of the host's chips or GPUs (distributed/topology.py), set here before JAX starts.
"""

from __future__ import annotations

import os

from tpu_agent import envvars

OFF = {"off", "0", "none", "false"}


def configure_environment() -> None:
    """Environment for XLA; cheap (no JAX import), so it runs when the package loads."""
    from .distributed import topology

    share = topology.rank_share()
    if share is not None:
        for name, value in share.environment.items():
            os.environ.setdefault(name, value)  # the user's own settings stay
    count = envvars.DEVICES.value  # None when unset; ValueError unless a positive integer
    if count is not None:
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


def compilation_cache_dir() -> str | None:
    """`$TPU_AGENT_XLA_CACHE`, else `xla/` in the tool's cache directory (`envvars.cache_dir()`), or
    None when turned off."""
    value = (envvars.XLA_CACHE.get() or "").strip()
    if value.lower() in OFF:
        return None
    if value:
        return value
    return str(envvars.cache_dir() / "xla")


_configured = False


def configure() -> None:
    global _configured
    if _configured:
        return
    _configured = True
    configure_environment()
    import jax

    jax.config.update("jax_enable_x64", True)
    cache = compilation_cache_dir()
    if cache is not None:
        jax.config.update("jax_compilation_cache_dir", cache)
        # Every program, however small: an eager op's compile is the cost a new process repeats.
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    from .distributed import runtime

    runtime.join()  # a rank of a torchrun job joins the job's JAX runtime before its first computation


def local_devices() -> tuple:
    """This process's JAX devices, in the order `tpu:0`, `tpu:1`... name them (JAX configured first)."""
    configure()
    import jax

    return tuple(jax.local_devices())
