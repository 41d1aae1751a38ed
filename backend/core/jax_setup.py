"""JAX configuration, applied before JAX first initialises its backends, and the device's 64-bit scope.

- 64-bit types, scoped to the device. PyTorch's int64 and float64 need JAX's 64-bit mode (with it off, JAX
  makes int64 values int32, silently where it takes them from the host). The process-wide `jax_enable_x64` is
  left as the user has it (off, JAX's default): the device runs every JAX call it makes under 64-bit through
  `device_x64` (a context and a decorator) and, on the hot path, `X64_SWAP`/`X64_SET` (JAX's thread-local
  switch, about 0.15 us a pair). The entry points hold it: every aten op (`TpuTensor.__torch_dispatch__` and the
  allocation and copy kernels), the three ways a program runs (`launch`, the fused recorder's `record` and
  `flush`: module and step programs, step boundaries and hooks reach JAX through them), host transfers,
  `synchronize`, collectives, sharding placement, the profiler's cost and memory analyses. A user's own JAX
  code in the same process sees JAX as configured. On a TPU, int64 stays 64-bit in XLA (emulated with 32-bit
  words there), as PyTorch/XLA keeps it by default (its `XLA_USE_32BIT_LONG=1` maps Long to 32-bit, the user
  vouching that values fit); the device narrows nothing silently. Not measured on a TPU.
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
    from ..distributed import topology

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

    _bind_x64(jax)
    cache = compilation_cache_dir()
    if cache is not None:
        jax.config.update("jax_compilation_cache_dir", cache)
        # Every program, however small: an eager op's compile is the cost a new process repeats.
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    from ..distributed import runtime

    runtime.join()  # a rank of a torchrun job joins the job's JAX runtime before its first computation


def local_devices() -> tuple:
    """This process's JAX devices, in the order `tpu:0`, `tpu:1`... name them (JAX configured first)."""
    configure()
    import jax

    return tuple(jax.local_devices())


# --- 64-bit, scoped to the device --------------------------------------------------------------------------------

X64_SWAP = None  # X64_SWAP(True) turns 64-bit on for this thread and returns what to hand X64_SET to undo it
X64_SET = None


def _bind_x64(jax) -> None:
    """JAX's thread-local `jax_enable_x64` switch (the `jax.enable_x64` context's own calls, without its object)."""
    global X64_SWAP, X64_SET
    X64_SWAP, X64_SET = jax.enable_x64.swap_local, jax.enable_x64.set_local


class device_x64:  # noqa: N801 - reads as a context manager
    """`with device_x64():` / `@device_x64()`: JAX calls inside use 64-bit types, on this thread only, whatever
    the process-wide setting; nesting is cheap and restores the caller's setting on exit."""

    __slots__ = ("previous",)

    def __enter__(self):
        if X64_SWAP is None:
            configure()
        self.previous = X64_SWAP(True)
        return self

    def __exit__(self, *exc) -> None:
        X64_SET(self.previous)

    def __call__(self, fn):
        import functools

        @functools.wraps(fn)
        def scoped(*args, **kwargs):
            if X64_SWAP is None:
                configure()
            previous = X64_SWAP(True)
            try:
                return fn(*args, **kwargs)
            finally:
                X64_SET(previous)

        return scoped

