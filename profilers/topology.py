"""The interconnect of each TPU generation: what pod-scale projection (tpu_agent.projection) costs collectives with.

Per chip, beside the compute and HBM figures of `backend/core/generations.py`. Sources:
- chips per slice, torus dimensionality, TensorCores per chip, bidirectional ICI per chip and DCN per chip:
  Google Cloud's system-architecture pages (cloud.google.com/tpu/docs/v4, v5e, v5p, v6e, tpu7x);
- ICI bandwidth per link and direction: "How to Scale Your Model" (Google DeepMind, 2025),
  https://jax-ml.github.io/scaling-book/tpus/ (its table of ICI one-way bandwidth per link).
Where a figure is not published for a generation the entry says what it assumes (`note`).
"""

from __future__ import annotations

from dataclasses import dataclass

_DOCS = "https://cloud.google.com/tpu/docs/"
_BOOK = "https://jax-ml.github.io/scaling-book/tpus/"


@dataclass(frozen=True)
class Interconnect:
    generation: str
    torus_dims: int  # 2: 2-D torus (v5e, v6e), 3: 3-D torus (v4, v5p, v7x)
    cores_per_chip: int  # the slice name counts TensorCores on v4/v5p/v7x, chips on v5e/v6e
    name_counts_cores: bool
    max_chips: int  # the largest slice of one pod
    ici_link_bandwidth: float  # bytes/s per link, one direction
    links_per_chip: int
    dcn_bandwidth: float  # bytes/s per chip between slices
    wraparound_from: int  # a torus dim of at least this many chips has wraparound links
    source: str
    note: str = ""
    host_bandwidth: float = 1.6e10  # bytes/s per chip and direction between HBM and host memory (offloading)
    host_note: str = "host link per chip assumed: PCIe Gen4 x16 (about 32 GB/s per direction) shared by 2 chips"

    @property
    def ici_bidirectional_per_chip(self) -> float:
        return 2 * self.ici_link_bandwidth * self.links_per_chip


INTERCONNECTS = {
    "v4": Interconnect("v4", 3, 2, True, 4096, 4.5e10, 6, 6.25e9, 4, f"{_DOCS}v4; {_BOOK}",
                       "DCN per chip assumed equal to v5p's (50 Gbps)"),
    "v5e": Interconnect("v5e", 2, 1, False, 256, 4.5e10, 4, 3.125e9, 16, f"{_DOCS}v5e; {_BOOK}",
                        "wraparound only on the full 16x16 pod's dims"),
    "v5p": Interconnect("v5p", 3, 2, True, 8960, 9e10, 6, 6.25e9, 4, f"{_DOCS}v5p; {_BOOK}"),
    "v6e": Interconnect("v6e", 2, 1, False, 256, 9e10, 4, 1.25e10, 16, f"{_DOCS}v6e; {_BOOK}",
                        "wraparound only on the full 16x16 pod's dims"),
    "v7x": Interconnect("v7x", 3, 2, True, 9216, 1e11, 6, 1.25e10, 4, f"{_DOCS}tpu7x",
                        "1.2 TB/s bidirectional ICI per chip split over 6 links; DCN assumed equal to v6e's; "
                        "slice names count TensorCores (2 per chip, each a JAX device), as xpk's tpu7x-4x4x4 = "
                        "64 chips = v7x-128", host_bandwidth=3.2e10,
                        host_note="host link per chip assumed: PCIe Gen5 x16 (about 64 GB/s per direction) shared by "
                                  "2 chips; no published figure (tpu-recipes' host-device microbenchmark is WIP)"),
}
