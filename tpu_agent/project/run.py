"""The parent side: start the partitioning child with N host devices, read its result, cost it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tpu_agent.errors import InputError, TpuAgentError
from tpu_agent.run.rendezvous import one_rank

from . import cost
from .results import Partitioned, Projection
from .slices import Slice

FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def partition(script: str, args: list[str], sl: Slice, mesh: dict[str, int], rules=(), batch_axis=None,
              scale_layers: bool = True, timeout: float | None = None, per_chip_batch: int | None = None,
              offload_block_inputs: bool = False) -> Partitioned:
    """`per_chip_batch`: the step traced with a global batch of that x the data-parallel degree (the mesh axes
    the batch is split over) in place of the script's. `offload_block_inputs`: the repeated blocks' inputs, saved
    for backward, held in host memory (MaxText's decoder_layer_input=offload)."""
    request = {"script": str(script), "args": list(args), "slice": sl.name, "generation": sl.generation,
               "chips": sl.chips, "mesh": mesh, "rules": [list(r) for r in rules], "batch_axis": batch_axis,
               "scale_layers": scale_layers, "offload_block_inputs": offload_block_inputs}
    if per_chip_batch is not None:
        request["batch"] = per_chip_batch * data_parallel(mesh, batch_axis)
        request["batch_option"] = f"--per-chip-batch {per_chip_batch}"
    with tempfile.TemporaryDirectory(prefix="tpu-agent-project-") as tmp:
        req, out = Path(tmp, "request.json"), Path(tmp, "result.json")
        req.write_text(json.dumps(request))
        env = one_rank(dict(os.environ))  # a torch.distributed script: a group of one rank
        flags = " ".join(f for f in env.get("XLA_FLAGS", "").split() if "force_host_platform_device_count" not in f)
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={sl.chips} {FAST_COMPILE}".strip()
        env["JAX_PLATFORMS"] = "cpu"
        proc = subprocess.run([sys.executable, "-m", "tpu_agent.project.partition", str(req), str(out)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
        if not out.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise TpuAgentError(f"projection failed (exit {proc.returncode}): {tail[0]}")
        data = json.loads(out.read_text())
    if "error" in data:
        if data.get("kind") == "input":
            raise InputError(data["error"].split(": ", 1)[-1])
        raise TpuAgentError(f"projection failed: {data['error']}")
    return Partitioned.model_validate(data)


def data_parallel(mesh: dict[str, int], batch_axis: str | None = None) -> int:
    """How many ways the batch is split: the plan's batch axis, else the data and fsdp axes."""
    from .placement import BATCH_AXES

    degree = 1
    for axis, size in mesh.items():
        if (axis == batch_axis) if batch_axis else axis in BATCH_AXES:
            degree *= size
    return degree


def project(script: str, args: list[str], sl: Slice, mesh: dict[str, int], **kw) -> tuple[Partitioned, Projection]:
    """`mesh` over every chip; across several slices (sl.slices) one slice is traced with the data axis divided by
    the slice count, and the cost model adds the gradients' all-reduce over DCN."""
    from .slices import in_slice_mesh

    partitioned = partition(script, args, sl, in_slice_mesh(mesh, sl), **kw)
    return partitioned, cost.project(partitioned, sl, mesh)
