"""The cost model: a partitioned step's figures (per chip) -> projected step time, MFU, memory on a slice.

Per generation, never per configuration: peak bf16 FLOP/s, HBM bandwidth and capacity
(backend/core/generations.py), ICI per link and torus (profilers/topology.py), and one fitted constant,
`MXU_EFFICIENCY` (the share of peak that large matmuls reach), fitted on the rows marked `fit` in
benchmarks/projection_table.py and checked on the others.

- compute: dot FLOPs, each dot's K and N padded to the MXU edge and M to 16 rows (profilers/padding.py; the
  attention lowering's dots left unpadded: a kernel's own tiling), / (peak x efficiency); other work: the bytes XLA's cost analysis says the non-dot ops
  move / HBM bandwidth, less what a TPU would not move through HBM (partition.py: the attention kernel's scores,
  XLA:CPU's float-width conversions, the collectives' own buffers). A chip's time is their sum: a TensorCore
  runs the step's fusions one after another, a dot fusion bound by the MXU and a non-dot one by HBM (the per-op
  roofline summed over the step; taking the larger of the two totals instead assumed the vector and memory work
  ran beside the MXU's, and put the 16B v5e row 6.5 points above its published MFU where the sum puts it 2.6).
- a collective over mesh axes runs as a ring along each torus dim those axes span, every spanned dim's links
  in both directions at once: all-gather and reduce-scatter move (n-1)/n of the full array, all-reduce twice
  that, all-to-all (n-1)/n over a quarter of the ring's bandwidth (bisection); plus 1 us per hop.
- overlap rule: collectives over the data-parallel and FSDP axes (weights gathered, gradients reduced) run
  asynchronously beside compute and cost only what exceeds it; collectives over any other axis (tensor,
  expert) sit on the critical path and add in full.
- a step traced with 2 and 1 repeated blocks is scaled to all of them linearly: per block = (2) - (1).
"""

from __future__ import annotations

import math

from tpu_agent.backend.core.generations import GENERATIONS
from tpu_agent.profilers.topology import INTERCONNECTS
from tpu_agent.slices import Slice

from .results import Collective, Partitioned, Projection, Traced

# Fitted by benchmarks/projection_table.py on its fit rows (2026-12-04; docs/benchmarks.md): v5e 0.941 (MaxText
# 32B, v5e-256), v5p 0.934 (MaxText 32B, v5p-128), v6e 0.743 (Llama 3.1 8B, v6e-256; it absorbs what the model
# misses there, host offloading among it). v4 has no published row: an assumed 0.80.
# v7x 0.717 (2026-12-07): fitted on the Ironwood recipes of Llama 3.1 70B on tpu7x-4x4x4 and tpu7x-4x8x8 (mean
# step-time error zero; docs/benchmarks.md).
MXU_EFFICIENCY = {"v4": 0.80, "v5e": 0.941, "v5p": 0.934, "v6e": 0.743, "v7x": 0.717}
FITTED = {"v5e": "fitted on MaxText 32B, v5e-256", "v5p": "fitted on MaxText 32B, v5p-128",
          "v6e": "fitted on MaxText Llama 3.1 8B, v6e-256",
          "v7x": "fitted on the Ironwood recipes of Llama 3.1 70B, tpu7x-4x4x4 and 4x8x8"}
HOP_LATENCY_S = 1e-6
DCN_LATENCY_S = 1e-5  # per slice hop of a ring over the data-center network (assumed)
OVERLAPPED_AXES = ("data", "fsdp")


def _axis_dims(mesh: dict[str, int], axes: list[str], torus: tuple[int, ...]) -> list[int]:
    """The torus dims along which devices of a group spanning `axes` differ (mesh row-major over device ids,
    device ids laid over the torus with dim 0 fastest)."""
    import numpy as np

    names, sizes = list(mesh), list(mesh.values())
    chips = math.prod(sizes)
    ids = np.arange(chips).reshape(sizes)
    index = tuple(slice(None) if n in axes else 0 for n in names)
    members = ids[index].reshape(-1)
    coords = np.array(np.unravel_index(members, tuple(reversed(torus)))).T[:, ::-1]
    return [d for d in range(len(torus)) if len(set(coords[:, d].tolist())) > 1]


def collective_seconds(c: Collective, sl: Slice, mesh: dict[str, int]) -> float:
    ic = INTERCONNECTS[sl.generation]
    n = c.group_size
    if n <= 1 or c.result_bytes == 0:
        return 0.0
    if c.dcn:  # a ring over the slices, each chip's share over its own DCN bandwidth
        return 2 * c.result_bytes * (n - 1) / n / ic.dcn_bandwidth + (n - 1) * DCN_LATENCY_S
    if c.kind == "collective-permute":
        return c.result_bytes / ic.ici_link_bandwidth + HOP_LATENCY_S
    dims = _axis_dims(mesh, c.axes, sl.torus) if c.axes else list(range(len(sl.torus)))
    bandwidth = sum(ic.ici_link_bandwidth * (2 if sl.wraparound[d] else 1) for d in dims) or ic.ici_link_bandwidth
    hops = sum(sl.torus[d] - 1 for d in dims)
    share = (n - 1) / n
    if c.kind == "all-gather":
        moved = c.result_bytes * share
    elif c.kind == "reduce-scatter":
        moved = c.result_bytes * n * share
    elif c.kind == "all-reduce":
        moved = 2 * c.result_bytes * share
    else:  # all-to-all
        moved = c.result_bytes * share * 4
    return moved / bandwidth + hops * HOP_LATENCY_S


def _scaled(programs: list[Traced], total: int | None, value) -> float:
    if len(programs) == 1 or not total:
        return value(programs[0])
    two, one = (programs[0], programs[1]) if programs[0].blocks == 2 else (programs[1], programs[0])
    return value(one) + (total - 1) * (value(two) - value(one))


def assumptions(sl: Slice, partitioned: Partitioned) -> list[str]:
    gen = GENERATIONS[sl.generation]
    ic = INTERCONNECTS[sl.generation]
    out = [
        f"chip: {gen.peak_bf16_flops / 1e12:.0f} TFLOP/s bf16 peak, MXU efficiency {MXU_EFFICIENCY[sl.generation]:.2f} "
        f"(one per generation; {FITTED.get(sl.generation, 'assumed: no published run fitted for ' + sl.generation)}), "
        f"HBM {gen.hbm_bandwidth / 1e12:.2f} TB/s, {gen.hbm_bytes / 2**30:.0f} GiB",
        f"slice: {sl.chips} chips as a {'x'.join(map(str, sl.torus))} {ic.torus_dims}-D "
        f"{'torus' if all(sl.wraparound) else 'mesh/torus (wraparound: ' + str(list(sl.wraparound)) + ')'}, ICI "
        f"{ic.ici_link_bandwidth / 1e9:.0f} GB/s per link and direction; mesh axes laid row-major over device ids, "
        "device ids over the torus dim 0 first",
        "collectives: rings along each spanned torus dim, both directions; data/fsdp collectives overlap compute, "
        "others add in full",
        "chip time = dot FLOPs with their MXU tile padding (K and N to the MXU edge, M to 16 rows; the attention "
        "kernel's dots unpadded) / (peak x efficiency) + non-dot bytes / HBM bandwidth (fusions run one after "
        "another, each bound by the MXU or by HBM); no host, "
        "input-pipeline or launch time",
        "FLOPs, bytes and memory from XLA's CPU compile of the partitioned step: fusion and layouts differ from a "
        "TPU compile; attention as one query-chunked op (flash-like: the scores are not saved, causal attention "
        "skips the key blocks above the diagonal, and the traffic of its non-dot ops is not counted as HBM "
        "traffic: a TPU's flash kernel keeps the scores on chip); XLA:CPU's bf16<->f32 conversions and the "
        "collectives' buffers are not counted as HBM traffic either",
        "memory per chip: parameters, optimizer state and batch as placed (XLA's argument and output sizes) plus "
        "the activations backward reads from forward, split by the batch axes; working buffers (a layer's "
        "transients, gathered weights, the logits' gradient) are not counted, and XLA:CPU's own temporaries "
        "(unfused, attention scores included) are shown apart, not used",
        "MFU counts 3x the forward matmul FLOPs (attention counted non-causal, as MaxText's published "
        "figures before its PR 1988) over peak x chips",
    ]
    if partitioned.offload_block_inputs:
        out.append(f"the repeated blocks' inputs saved for backward are held in host memory (offloaded), copied "
                   f"over a host link of {ic.host_bandwidth / 1e9:.0f} GB/s per chip and direction beside compute "
                   f"({ic.host_note})")
    if sl.read_as:
        out.append(sl.read_as)
    if sl.slices > 1:
        out.append(f"{sl.slices} slices: one slice traced (the data axis divided by {sl.slices}); across slices each "
                   f"chip all-reduces its gradient shard (its parameters' bytes as placed) over DCN at "
                   f"{ic.dcn_bandwidth / 1e9:.1f} GB/s per chip (profilers/topology.py; assumed for v4 and v7x), "
                   f"{DCN_LATENCY_S * 1e6:.0f} us per slice hop, overlapping compute as data-parallel collectives do")
    if partitioned.traced_mesh:
        traced = ",".join(f"{k}={v}" for k, v in partitioned.traced_mesh.items())
        out.append(f"re-costed from the step traced on one slice as {traced} (projection/remesh.py): the same per-chip "
                   "work; parameters and optimizer state replicated over data, weight gathers and gradient "
                   "reduce-scatters over the smaller fsdp groups, gradients all-reduced over data")
    if partitioned.blocks_total:
        out.append(f"traced with 2 and 1 of the {partitioned.blocks_total} repeated blocks "
                   f"({partitioned.blocks_name}); every figure scaled linearly to {partitioned.blocks_total}")
    return out


def _with_dcn(programs: list[Traced], sl: Slice) -> list[Traced]:
    """Across slices (multislice, data parallel over DCN) each chip all-reduces its share of the gradients with its
    counterparts in the other slices: one all-reduce of the parameters' bytes per chip as placed, beside the
    traced slice's own collectives (it overlaps backward as the data axis does)."""
    if sl.slices <= 1:
        return programs
    return [p.model_copy(update={"collectives": [*p.collectives, Collective(
        kind="all-reduce", result_bytes=int(p.param_bytes), group_size=sl.slices, groups=sl.chips, axes=["data"],
        name="gradients across slices (DCN, modelled)", dcn=True)]}) for p in programs]


def project(partitioned: Partitioned, sl: Slice, mesh: dict[str, int] | None = None) -> Projection:
    """`mesh`: the whole mesh across slices (multislice); the partitioned step is one slice's."""
    gen = GENERATIONS[sl.generation]
    full_mesh = dict(mesh or partitioned.mesh)
    mesh = partitioned.mesh
    programs, total = _with_dcn(partitioned.programs, sl), partitioned.blocks_total
    for p in programs:
        for c in p.collectives:
            c.seconds = collective_seconds(c, sl, mesh)

    def times(p: Traced) -> tuple[float, float, float, float]:
        compute = (p.dot_flops + p.dot_padding_flops) / (gen.peak_bf16_flops * MXU_EFFICIENCY[sl.generation])
        memory = max(p.bytes_accessed - p.dot_bytes - p.attention_bytes - p.convert_bytes - p.collective_bytes,
                     0.0) / gen.hbm_bandwidth
        overlapped = sum(c.seconds for c in p.collectives if c.axes and set(c.axes) <= set(OVERLAPPED_AXES))
        exposed = sum(c.seconds for c in p.collectives) - overlapped
        return compute, memory, overlapped, exposed

    compute = _scaled(programs, total, lambda p: times(p)[0])
    memory = _scaled(programs, total, lambda p: times(p)[1])
    overlapped = _scaled(programs, total, lambda p: times(p)[2])
    critical = _scaled(programs, total, lambda p: times(p)[3])
    local = compute + memory
    dcn = _scaled(programs, total, lambda p: sum(c.seconds for c in p.collectives if c.dcn))
    host = _scaled(programs, total, lambda p: p.host_saved_bytes)
    host_s = 2 * host / INTERCONNECTS[sl.generation].host_bandwidth  # written in forward, read back in backward
    exposed = max(0.0, overlapped - local) + max(0.0, host_s - local) + critical
    step = local + exposed
    # What sets the step: data/fsdp collectives longer than the chip's own work are a floor (a larger per-chip
    # batch adds no time until compute + memory reach them); else the largest of the parts that add up.
    parts = {"compute": compute, "memory": memory, "critical collectives": critical}
    bound = ("overlapped collectives" if overlapped > local else "host offload" if host_s > local
             else max(parts, key=parts.get) if step > 0 else "")
    model_flops = _scaled(programs, total, lambda p: p.model_flops) * sl.slices
    hbm = _scaled(programs, total, lambda p: p.argument_bytes + p.output_bytes - p.alias_bytes + p.saved_bytes)
    xla_cpu = _scaled(programs, total, lambda p: p.argument_bytes + p.output_bytes - p.alias_bytes + p.temp_bytes)
    by_axis: dict[str, float] = {}
    by_kind: dict[str, float] = {}
    for key in {"+".join(c.axes) or "-" for p in programs for c in p.collectives}:
        by_axis[key] = _scaled(programs, total, lambda p: sum(c.seconds for c in p.collectives
                                                               if ("+".join(c.axes) or "-") == key))
    for kind in {c.kind for p in programs for c in p.collectives}:
        by_kind[kind] = _scaled(programs, total, lambda p: sum(c.result_bytes for c in p.collectives if c.kind == kind))
    widest = max(programs, key=lambda p: p.blocks or 0)
    return Projection(
        label=f"projected for {sl.name}", read_as=sl.read_as, memory_margin_bytes=gen.hbm_bytes - hbm,
        host_offload_bytes_per_chip=host, host_transfer_s=host_s,
        slice=sl.name, generation=sl.generation, chips=sl.total_chips, mesh=full_mesh, step_s=step, compute_s=compute,
        memory_s=memory, collective_s=overlapped + critical, dcn_s=dcn, exposed_collective_s=exposed, bound=bound,
        collective_by_axis=by_axis, collective_bytes_by_kind=by_kind,
        flops_per_chip=_scaled(programs, total, lambda p: p.flops),
        dot_flops_per_chip=_scaled(programs, total, lambda p: p.dot_flops), model_flops=model_flops,
        mfu=model_flops / (step * gen.peak_bf16_flops * sl.total_chips) if step > 0 else 0.0,
        hbm_bytes_per_chip=hbm, xla_cpu_bytes_per_chip=xla_cpu, hbm_capacity=float(gen.hbm_bytes), fits=hbm <= gen.hbm_bytes,
        collectives=widest.collectives, assumptions=assumptions(sl, partitioned),
        sources=[gen.source, INTERCONNECTS[sl.generation].source])
