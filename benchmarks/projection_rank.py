"""The projected ranking `tune --target SLICE --slices N` makes, timed on a model at real size (an estimate: no TPU
runs). The tune's own path (parallelism/target.py) starts from a baseline run of the script on this host, which a
235B model cannot have; this runs the same search (projection/rank.py over run.projection.SliceProjector) on
benchmarks/projection_model.py directly, the tensor-parallel widths given from the model's Linear layers.

    .venv/bin/python benchmarks/projection_rank.py [--budget 3] [--json ranking.json]

Default: the seed's scale, a Qwen3-235B-A22B-style MoE (projection_table.py's dims) on 32 slices of tpu7x-4x8x8
(8,192 chips), 32 sequences of 4096 per chip (the published 256-chip recipe's), every layer recomputed from its
input held on the host (the recipe's offload), data across the slices over DCN.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from projection_table import MODEL, QWEN3_235B  # noqa: E402

from tpu_agent import slices  # noqa: E402
from tpu_agent.projection import rank  # noqa: E402
from tpu_agent.run.projection import projector  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--target", default="tpu7x-4x8x8")
    p.add_argument("--slices", type=int, default=32)
    p.add_argument("--per-chip-batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--budget", type=int, default=3, help="traces (each data x fsdp split of a trace is free)")
    p.add_argument("--json", help="write the ranking here")
    a = p.parse_args()
    sl = slices.multislice(slices.read(a.target), a.slices)
    batch = a.per_chip_batch * sl.total_chips
    args = [*QWEN3_235B, "--batch", str(batch), "--seq", str(a.seq), "--remat", "full"]
    # the Linear widths a tensor split cuts: q (4096 -> 64 x 128), k and v (4096 -> 4 x 128), o, the router (128)
    dims = [4096, 8192, 512, 128]
    began, cpu0 = time.perf_counter(), os.times()
    load0 = os.getloadavg()[0]

    def say(line: str) -> None:
        print(f"[{time.perf_counter() - began:6.0f} s] {line}", flush=True)

    ranking = rank.rank(sl, projector(MODEL, args, sl, batch, offload=True), dims, batch, budget=a.budget, say=say)
    cpu1 = os.times()
    wall = time.perf_counter() - began
    cpu = (cpu1.children_user + cpu1.children_system + cpu1.user + cpu1.system
           - cpu0.children_user - cpu0.children_system - cpu0.user - cpu0.system)
    print(f"\n{ranking.label}: {ranking.projections} plans ranked from {ranking.traces} traces in {wall:.0f} s wall, "
          f"{cpu:.0f} s CPU (load {load0:.1f} -> {os.getloadavg()[0]:.1f}); estimates, never verified")
    print("| rank | mesh | per-chip batch | checkpointing | step | MFU | memory per chip (HBM) | fits | DCN | from |")
    print("|---:|---|---:|---|---:|---:|---:|---|---:|---|")
    for i, q in enumerate(ranking.ranked, 1):
        mesh = ",".join(f"{k}={v}" for k, v in q.plan.mesh.items())
        if q.error:
            print(f"| {i} | {mesh} | {q.plan.per_chip_batch} | {q.plan.checkpoint} | failed: {q.error} |||||||")
            continue
        src = "traced" if q.recosted_from is None else "re-costed from " + ",".join(
            f"{k}={v}" for k, v in q.recosted_from.items())
        print(f"| {i} | {mesh} | {q.plan.per_chip_batch} | {'every block' if q.plan.checkpoint else 'as the script'} "
              f"| {q.step_s:.3g} s | {q.mfu * 100:.1f}% | {q.memory_per_chip_bytes / 2**30:.1f} GiB | "
              f"{'yes' if q.fits else 'no'} | {q.dcn_s:.3g} s | {src} |")
    best = ranking.after
    if best is not None:
        print(f"\nbest ({ranking.label}, an estimate): {best.plan.describe()}: step {best.step_s:.3g} s, MFU "
              f"{best.mfu * 100:.1f}% (the projection's count), {rank.fit_text(best)}")
    for note in ranking.notes:
        print(f"note: {note}")
    if a.json:
        Path(a.json).write_text(ranking.model_dump_json(indent=2) + "\n")
    return 0 if math.isfinite(wall) else 1


if __name__ == "__main__":
    sys.exit(main())
