"""A projection in a child process of its own (the engine is tpu_agent.projection).

The parent (`partition`, `project`, `projector`) starts the child with N host devices, reads its result and costs
it; the child (`python -m tpu_agent.run.projection REQUEST.json RESULT.json`) applies the run's device map, if
any, then records and partitions the script's step (projection.partition.run).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tpu_agent import envvars
from tpu_agent.errors import InputError, TpuAgentError
from tpu_agent.projection import checkpointed, cost, remesh
from tpu_agent.projection.placement import data_parallel
from tpu_agent.projection.rank import ProjectedPlan, Projector, SlicePlan
from tpu_agent.projection.results import Partitioned, Projection
from tpu_agent.run.rendezvous import one_rank
from tpu_agent.slices import Slice, in_slice_mesh

FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
PROJECTION_TIMEOUT_S = 900.0  # a projector's projection running longer is stopped, recorded as failed (70B: 2 min)
CHECKPOINTED = checkpointed.__file__  # the script run under it: every repeated block checkpointed


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
        proc = subprocess.run([sys.executable, "-m", "tpu_agent.run.projection", str(req), str(out)], env=env,
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


def project(script: str, args: list[str], sl: Slice, mesh: dict[str, int], **kw) -> tuple[Partitioned, Projection]:
    """`mesh` over every chip; across several slices (sl.slices) one slice is traced with the data axis divided by
    the slice count, and the cost model adds the gradients' all-reduce over DCN."""
    partitioned = partition(script, args, sl, in_slice_mesh(mesh, sl), **kw)
    return partitioned, cost.project(partitioned, sl, mesh)


class SliceProjector:
    """Projections for projection.rank's search, each trace in a child process (`project`'s), shared: one trace per
    (checkpointing, per-chip batch, axes other than data and fsdp), on the widest fsdp axis those leave in a slice;
    every data x fsdp split of the same chips re-costed from it (projection/remesh.py: the same per-chip work, the
    parameters replicated over data, the gradients all-reduced over it). `traces` counts what the ranking cost;
    `free(plan)` says whether a plan's trace is made. The checkpointed plans run the script under
    projection/checkpointed.py."""

    def __init__(self, script: str, args: list[str], sl: Slice, script_batch: int | None = None, offload: bool = False):
        self.script, self.args, self.sl, self.script_batch, self.offload = script, list(args), sl, script_batch, offload
        self.traces = 0
        self._traced: dict[tuple, Partitioned | str] = {}  # trace key -> the partitioned step, or why it failed

    def _traced_mesh(self, plan: SlicePlan) -> dict[str, int]:
        """The in-slice mesh the plan's trace is made on: its axes other than data and fsdp, fsdp over the rest."""
        inner = in_slice_mesh(plan.mesh, self.sl)
        others = {k: v for k, v in inner.items() if k not in ("data", "fsdp") and v > 1}
        rest = self.sl.chips // math.prod(others.values())
        return ({"fsdp": rest} if rest > 1 else {}) | others or {"fsdp": 1}

    def _key(self, plan: SlicePlan) -> tuple:
        """The script's own batch (per_chip_batch None) traces as its share per chip where that divides evenly."""
        per_chip, dp = plan.per_chip_batch, data_parallel(plan.mesh)
        if per_chip is None and self.script_batch and self.script_batch % dp == 0:
            per_chip = self.script_batch // dp
        return plan.checkpoint, per_chip, tuple(sorted(self._traced_mesh(plan).items()))

    def free(self, plan: SlicePlan) -> bool:
        try:
            return self._key(plan) in self._traced
        except InputError:
            return False

    def __call__(self, plan: SlicePlan) -> tuple[ProjectedPlan, int | None]:
        dp = data_parallel(plan.mesh)
        batch = plan.per_chip_batch * dp if plan.per_chip_batch is not None else self.script_batch
        failed = lambda error: (ProjectedPlan(plan=plan, global_batch=batch, error=error), None)  # noqa: E731
        try:
            key, inner = self._key(plan), in_slice_mesh(plan.mesh, self.sl)
        except InputError as exc:
            return failed(str(exc).splitlines()[0][:300])
        if key not in self._traced:
            self.traces += 1
            ran, ran_args = (CHECKPOINTED, [self.script, *self.args]) if plan.checkpoint else (self.script, self.args)
            # across slices one slice is traced: the script's own batch is given as its share per chip there
            per_chip = key[1] if self.sl.slices > 1 else plan.per_chip_batch
            try:
                self._traced[key] = partition(ran, ran_args, self.sl, self._traced_mesh(plan), timeout=PROJECTION_TIMEOUT_S,
                                              per_chip_batch=per_chip, offload_block_inputs=self.offload)
            except TpuAgentError as exc:
                self._traced[key] = str(exc).splitlines()[0][:300]
            except subprocess.TimeoutExpired:
                self._traced[key] = f"the projection ran past {PROJECTION_TIMEOUT_S:.0f} s and was stopped"
        traced = self._traced[key]
        if isinstance(traced, str):
            return failed(traced)
        partitioned = remesh.remesh(traced, inner)
        p = cost.project(partitioned, self.sl, plan.mesh)
        return ProjectedPlan(
            plan=plan, global_batch=batch, step_s=p.step_s, time_per_sample_s=p.step_s / batch if batch else None,
            mfu=p.mfu, memory_per_chip_bytes=p.hbm_bytes_per_chip, hbm_bytes=p.hbm_capacity, fits=p.fits,
            exposed_collective_s=p.exposed_collective_s, host_offload_bytes_per_chip=p.host_offload_bytes_per_chip,
            assumptions=p.assumptions, dcn_s=p.dcn_s, recosted_from=partitioned.traced_mesh), traced.blocks_total


def projector(script: str, args: list[str], sl: Slice, script_batch: int | None = None,
              offload: bool = False) -> SliceProjector:
    """Projections for projection.rank's search (SliceProjector: one trace shared by the data x fsdp splits)."""
    return SliceProjector(script, args, sl, script_batch, offload)


def main(argv: list[str]) -> int:
    """The child: the request's script recorded and partitioned; the result, or one line of why not, in RESULT."""
    request = json.loads(open(argv[0]).read())
    try:
        from tpu_agent.projection import partition, record

        mapped = envvars.DEVICE_MAP.pop()
        if mapped is not None:  # tune --device-map cuda=tpu: the script's device is tpu in its projection too
            from tpu_agent.backend.integration import module as device_module
            from tpu_agent.run import device_map

            device_module.claim()  # as the tool's child does: torch.cuda.is_available() answers for tpu
            mapping = device_map.parse(mapped)
            device_map.apply(mapping, say=lambda line: None)
            record.META_DEVICES.add(mapping.source)
        result = partition.run(request)
    except Exception as exc:  # the parent shows one line
        kind = "input" if isinstance(exc, InputError) else "failed"
        with open(argv[1], "w") as f:
            json.dump({"error": f"{type(exc).__name__}: {exc}", "kind": kind}, f)
        if kind == "failed":
            import traceback

            traceback.print_exc()
        return 2 if kind == "input" else 1
    with open(argv[1], "w") as f:
        f.write(result.model_dump_json())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
