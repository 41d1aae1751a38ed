"""JAX configuration, applied before JAX first initialises its backends.

- 64-bit types on, so int64 and float64 keep PyTorch's semantics.
- `TPU_AGENT_DEVICES=N` simulates N devices on a CPU host (XLA's
  `--xla_force_host_platform_device_count`), for sharding on one machine.
"""

from __future__ import annotations

import os


def configure_environment() -> None:
    """Environment for XLA; cheap (no JAX import), so it runs when the package loads."""
    count = os.environ.get("TPU_AGENT_DEVICES", "")
    if count:
        if not count.isdigit() or int(count) < 1:
            raise ValueError(f"TPU_AGENT_DEVICES={count!r} must be a positive integer")
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


def configure() -> None:
    configure_environment()
    import jax

    jax.config.update("jax_enable_x64", True)
