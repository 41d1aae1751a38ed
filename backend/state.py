"""Process-wide device state: RNG, eager mode, matmul precision, counters."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from tpu_agent import envvars


@dataclass
class Stats:
    """What the profiler reads: fallbacks, transfers, compilations."""

    ops: int = 0
    compiles: int = 0
    fallbacks: Counter = field(default_factory=Counter)
    h2d_count: int = 0
    h2d_bytes: int = 0
    d2h_count: int = 0
    d2h_bytes: int = 0

    def reset(self) -> None:
        self.__init__()


class Rng:
    """Counter-based on-device RNG: key = fold_in(PRNGKey(seed), counter).

    The key is derived inside each jitted random op, so drawing costs no extra
    dispatch; `torch.manual_seed` resets seed and counter, which makes runs
    reproducible.
    """

    def __init__(self) -> None:
        self.seed: int | None = None
        self.counter = 0
        self._base = None

    def manual_seed(self, seed: int) -> None:
        self.seed = int(seed) & 0xFFFFFFFFFFFFFFFF
        self.counter = 0
        self._base = None

    def initial_seed(self) -> int:
        if self.seed is None:
            import torch

            self.manual_seed(torch.initial_seed())
        return self.seed

    def base(self):
        """The seed's key (no draw)."""
        if self._base is None:
            import jax
            import numpy as np

            self._base = jax.random.PRNGKey(np.uint64(self.initial_seed()))
        return self._base

    def next(self):
        """(base key, counter) to pass to a random lowering."""
        import numpy as np

        base = self.base()
        self.counter += 1
        return base, np.uint32(self.counter)

    def get_state(self) -> tuple[int, int]:
        return self.initial_seed(), self.counter

    def set_state(self, seed: int, counter: int) -> None:
        self.manual_seed(seed)
        self.counter = int(counter)


STATS = Stats()
RNG = Rng()


def cpu_fallback_enabled() -> bool:
    return envvars.CPU_FALLBACK.value
