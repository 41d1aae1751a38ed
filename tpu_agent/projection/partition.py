"""In the projection's child process: record the script's step on meta, lower it, partition it for N devices,
read XLA's figures.

The child is `python -m tpu_agent.run.projection REQUEST.json RESULT.json` with XLA_FLAGS naming N host devices
(set by the parent before JAX starts); it calls `run(request)`. Nothing is allocated: the program is lowered from
abstract arrays.
"""

from __future__ import annotations

import time
import warnings

from .results import Partitioned, Traced


def _matmul_flops(graph) -> float:
    """3 x the forward matmul FLOPs of the step (forward once, backward twice): the MFU numerator."""
    import torch

    from . import attention

    aten = torch.ops.aten
    shapes = {}
    total = 0.0
    for vid, (shape, *_rest) in graph.inputs.items():
        shapes[vid] = shape
    for node in graph.nodes:
        for vid, shape in zip(node.outs, node.out_shapes):
            if vid is not None:
                shapes[vid] = shape
        if node.backward:
            continue
        arg = [shapes.get(a.vid) if hasattr(a, "vid") else a for a in node.args]
        if node.func in (aten.mm.default, aten.bmm.default):
            a, b = arg[0], arg[1]
            total += 2.0 * _prod(a) * b[-1]
        elif node.func is aten.addmm.default:
            a, b = arg[1], arg[2]
            total += 2.0 * _prod(a) * b[-1]
        elif node.func is torch.ops.tpu_project.attention.default:
            total += attention.flops(arg[0], arg[1], arg[2], backward=False)
    return 3.0 * total


def _prod(shape) -> float:
    out = 1.0
    for d in shape:
        out *= d
    return out


def _dtype(torch_dtype):
    import jax.numpy as jnp

    return jnp.dtype(str(torch_dtype).replace("torch.", ""))


def _activation_rule(mesh, mesh_axes: dict, batch_sizes: set, graph, batch_axis, param_specs: dict):
    """Activations keep the batch split (dim 0 of the size of a batch input, or batch x sequence, over the
    batch axes), as a framework's activation sharding annotations do; other dims are left to XLA. In backward,
    a value shaped like a sharded parameter (its gradient) is placed as the parameter is, so that XLA reduce-scatters
    it rather than choosing to gather activations (it still does in some cases: docs/projection.md)."""
    from jax.sharding import NamedSharding, PartitionSpec

    from . import placement

    axes = [batch_axis] if batch_axis else [a for a in mesh_axes if a in placement.BATCH_AXES and mesh_axes[a] > 1]
    size = 1
    for a in axes:
        size *= mesh_axes[a]
    lead = set()
    for v, (shape, *_rest) in graph.inputs.items():
        if graph.inputs[v][2] == "data" and len(shape) >= 1 and shape[0] in batch_sizes:
            lead.add(shape[0])
            if len(shape) >= 2:
                lead.add(shape[0] * shape[1])
    lead = {n for n in lead if n % size == 0} if axes and size > 1 else set()
    entry = tuple(axes) if len(axes) > 1 else axes[0]
    cache = {}

    grads = {shape: NamedSharding(mesh, PartitionSpec(*spec)) for shape, spec in param_specs.items()
             if spec is not None and any(spec)}

    def rule(shape, backward=False, dim=0):
        if backward and shape in grads:  # before the batch rule: a feature dim may equal the batch size
            return grads[shape]
        if dim is None or not shape or dim >= len(shape) or shape[dim] not in lead:
            return None
        key = (len(shape), dim)
        if key not in cache:
            spec = [PartitionSpec.UNCONSTRAINED] * len(shape)
            spec[dim] = entry
            cache[key] = NamedSharding(mesh, PartitionSpec(*spec))
        return cache[key]

    return rule


_PLUMBING = ("parameter", "constant", "tuple", "get-tuple-element", "bitcast")
_CONVERT_ONLY = {"convert", "parameter", "bitcast", "broadcast", "reshape", "copy", "transpose"}


def _non_dot_split(module) -> tuple[float, float, float]:
    """Bytes of the entry computation's non-dot ops that XLA's cost analysis counts but a TPU does not move
    through HBM as such, per chip: (attention, conversions, collectives).

    - attention: the lowering's scores, masks and exponentials (named scope); a TPU runs attention as one fused
      flash kernel (MaxText: splash attention) whose scores stay on chip, where XLA:CPU writes each to memory;
    - conversions: ops that only convert between float widths (with layout plumbing): XLA:CPU runs bf16 dots and
      arithmetic in f32 and materialises the casts; the MXU reads bf16 operands, and a TPU compile fuses casts
      into their consumers;
    - collectives: their buffers move over ICI and are costed there (cost.py), not as HBM traffic."""
    from . import attention, collectives

    if module.entry is None:
        return 0.0, 0.0, 0.0

    def inner(inst) -> list:
        found = []
        for called in inst.called:
            for i in module.computations.get(called, []):
                found += [i, *inner(i)]
        return found

    insts = module.computations.get(module.entry, [])
    shapes = {i.name: i.shape for i in insts}
    scores = converts = moved = 0.0
    for inst in insts:
        if inst.opcode in _PLUMBING:
            continue
        body = inner(inst)
        ops = {i.opcode for i in body}
        if inst.opcode in ("dot", "convolution") or ops & {"dot", "convolution"}:
            continue
        arrays = list(inst.shape) + [a for o in inst.operands for a in shapes.get(o, [])]
        size = sum(a.elements * a.bits / 8 for a in arrays)
        if any(attention.SCOPE in (i.op_name or "") for i in [inst, *body]):
            scores += size
        elif inst.opcode.removesuffix("-start").removesuffix("-done") in collectives.KINDS:
            moved += size
        elif inst.opcode == "convert" or (inst.opcode == "fusion" and "convert" in ops and ops <= _CONVERT_ONLY):
            converts += size
    return scores, converts, moved


def _dot_padding(module, generation: str | None) -> tuple[float, float, float]:
    """FLOPs the MXU spends on tile padding, per chip: each dot's K and N padded to the generation's MXU edge and
    M to the bf16 sublane count (profilers/padding.py's model), less its own FLOPs. Returns (padding of the dots
    outside the attention lowering, padding of the attention lowering's dots, the attention dots' FLOPs). A grouped
    (expert) matmul of 2880 columns runs as 3072 on a 256-wide MXU; the attention kernel's dots (head_dim 64 or
    128 against 256) are kept apart: the cost model does not charge them (docs/projection.md)."""
    from tpu_agent.profilers import hlo, padding

    from . import attention

    if module.entry is None or generation is None:
        return 0.0, 0.0, 0.0
    tiling = padding.Tiling.of(generation)
    other = scores = scores_flops = 0.0
    seen: set[str] = set()

    def walk(name: str, scoped: bool) -> None:
        nonlocal other, scores, scores_flops
        insts = module.computations.get(name, [])
        shapes = {i.name: i.shape[0] for i in insts if i.shape}
        for inst in insts:
            inside = scoped or attention.SCOPE in (inst.op_name or "")
            c = hlo.contraction(inst, shapes) if inst.opcode == "dot" else None
            if c is not None:
                d = c.dot_dims
                waste = padding.dot_waste(c.lhs.dims, c.rhs.dims, d["lhs_contracting"], d["rhs_contracting"],
                                          d["lhs_batch"], d["rhs_batch"], tiling=tiling, bits=16)
                extra = 2.0 * (waste.padded - waste.useful)
                if inside:
                    scores += extra
                    scores_flops += c.flops
                else:
                    other += extra
            for called in inst.called:
                if called not in seen and inst.opcode in ("fusion", "call", "while", "conditional"):
                    seen.add(called)
                    walk(called, inside)

    walk(module.entry, False)
    return other, scores, scores_flops


def _narrow_bits(graph) -> int | None:
    """16 when every parameter and optimizer-state input of the step is bf16 or f16 (a step held in half
    precision, whose f32 collectives are XLA:CPU's widening); else None."""
    import torch

    floats = [dtype for shape, dtype, role, _name in graph.inputs.values()  # an optimizer's step count is a scalar
              if role in ("param", "state") and dtype.is_floating_point and len(shape) > 0]
    return 16 if floats and all(d in (torch.bfloat16, torch.float16) for d in floats) else None


def _saved_per_chip(saved, mesh_axes: dict, batch_axis, offload: bool = False) -> tuple[int, int]:
    """Bytes per chip of the activations backward reads from forward (lower.py's list: no inputs, nothing shaped
    like a parameter): a batch-led value split over the batch axes and, where the mesh has a tensor or expert
    axis and another dim divides by it, over that axis too (as Megatron's and MaxText's activation sharding
    does); others whole. Computed from the placement, not read from XLA:CPU's buffers (its figure is apart).
    Returns (in HBM, in host memory): with `offload`, the repeated blocks' inputs are held on the host (MaxText's
    decoder_layer_input=offload), the rest in HBM."""
    from . import placement

    axes = [batch_axis] if batch_axis else [a for a in mesh_axes if a in placement.BATCH_AXES]
    size = 1
    for a in axes:
        size *= mesh_axes.get(a, 1)
    others = [mesh_axes[a] for a in mesh_axes if a in placement.TENSOR_AXES + ("expert",) and mesh_axes[a] > 1]
    total = host = 0.0
    for shape, itemsize, dim, *block_input in saved:
        n = _prod(shape) * itemsize
        if dim is not None and dim < len(shape) and shape[dim] % size == 0:
            n /= size
            rest = [d for i, d in enumerate(shape) if i != dim]
            for split in others:
                if any(d % split == 0 and d >= split for d in rest):
                    n /= split
        if offload and block_input and block_input[0]:
            host += n
        else:
            total += n
    return int(total), int(host)


def partition_graph(graph, mesh_axes: dict, rules, batch_axis, placements: dict, offload: bool = False,
                    generation: str | None = None) -> Traced:
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from tpu_agent.profilers import hlo

    from . import collectives, lower, placement

    # the persistent compilation cache keys on the module without its metadata by default; the attention
    # scope is read from the metadata, so a module cached before it was named must not stand in for it
    jax.config.update("jax_compilation_cache_include_metadata_in_key", True)
    n = 1
    for v in mesh_axes.values():
        n *= v
    devices = np.array(jax.devices()[:n]).reshape(tuple(mesh_axes.values()))
    mesh = Mesh(devices, tuple(mesh_axes))
    batch_sizes = {graph.inputs[v][0][0] for v in graph.inputs if graph.inputs[v][2] == "data" and graph.inputs[v][0]}
    param_specs: dict = {}
    for shape, _kind, role, name in graph.inputs.values():
        if role == "param":
            spec = placement.spec_for(role, name, shape, mesh_axes, rules, batch_axis)
            param_specs[tuple(shape)] = spec if param_specs.get(tuple(shape), spec) == spec else None
    fn = lower.Lowered(graph, _activation_rule(mesh, mesh_axes, batch_sizes, graph, batch_axis, param_specs))
    avals, shardings, specs = [], [], {}
    param_bytes = 0.0  # per chip, as placed: what a data-parallel all-reduce across slices moves as gradients
    fsdp_state = fsdp_params = 0.0  # per chip: parameters and optimizer state split over fsdp; the parameters alone
    for vid in fn.input_ids:
        shape, dtype, role, name = graph.inputs[vid]
        spec = placement.spec_for(role, name, shape, mesh_axes, rules, batch_axis)
        specs[vid] = spec
        if role in ("param", "state"):
            shards, used = 1, set()
            for axes in spec:
                for axis in ([axes] if isinstance(axes, str) else list(axes or [])):
                    shards *= mesh_axes[axis]
                    used.add(axis)
            here = _prod(shape) * dtype.itemsize / shards
            param_bytes += here if role == "param" else 0.0
            if "fsdp" in used:  # what a data axis carved out of fsdp would replicate (remesh.py)
                fsdp_state += here
                fsdp_params += here if role == "param" else 0.0
        if role == "param" and len(placements) < 400:
            placements[name] = list(spec)
        sharding = NamedSharding(mesh, PartitionSpec(*spec))
        avals.append(jax.ShapeDtypeStruct(shape, _dtype(dtype), sharding=sharding))
        shardings.append(sharding)
    index = {vid: i for i, vid in enumerate(fn.input_ids)}
    out_shardings = [shardings[index[v]] if v in index else None for v in fn.output_ids]
    donate = tuple(index[v] for v in fn.output_ids if v in index)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = jax.jit(fn, in_shardings=shardings, out_shardings=out_shardings,
                           donate_argnums=donate).lower(*avals).compile()
    compile_s = time.perf_counter() - t0
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    memory = compiled.memory_analysis()
    module = hlo.parse_module(compiled.as_text())
    dot_flops = dot_bytes = 0.0
    for op in hlo.hot_ops(module):
        for c in op.contractions:
            dot_flops += c.flops
            dot_bytes += sum(a.elements * a.bits / 8 for a in (c.lhs, c.rhs, c.out))
    scores, converts, moved = _non_dot_split(module)
    padded, attention_padded, attention_dots = _dot_padding(module, generation)
    device_saved, host_saved = _saved_per_chip(fn.saved, mesh_axes, batch_axis, offload)
    return Traced(
        blocks=graph.blocks, attention_bytes=scores, convert_bytes=converts, collective_bytes=moved,
        saved_bytes=device_saved, host_saved_bytes=host_saved, param_bytes=param_bytes, fsdp_state_bytes=fsdp_state,
        fsdp_param_bytes=fsdp_params, flops=float(cost.get("flops", 0.0)),
        dot_flops=dot_flops, dot_padding_flops=padded, attention_dot_flops=attention_dots,
        attention_padding_flops=attention_padded,
        bytes_accessed=float(cost.get("bytes accessed", 0.0)), dot_bytes=dot_bytes,
        argument_bytes=int(memory.argument_size_in_bytes), output_bytes=int(memory.output_size_in_bytes),
        alias_bytes=int(memory.alias_size_in_bytes), temp_bytes=int(memory.temp_size_in_bytes),
        model_flops=_matmul_flops(graph), collectives=collectives.collectives(module, mesh_axes, _narrow_bits(graph)),
        compile_s=compile_s, ops=len(graph.nodes))


def run(request: dict) -> Partitioned:
    """The request's script recorded, then each recorded program partitioned, with 64-bit types as the device
    runs them (the device's lowerings are lowered here)."""
    from tpu_agent.backend.core.jax_setup import device_x64

    with device_x64():
        return _run(request)


def _run(request: dict) -> Partitioned:
    """The request's script recorded, then each recorded program partitioned (a device map, if any, was applied
    by the caller: its source device is in record.META_DEVICES)."""
    from . import lower, record

    t0 = time.perf_counter()
    recording = record.record(request["script"], request["args"], scale_layers=request.get("scale_layers", True),
                              lowerable=lower.lowerable, batch=request.get("batch"),
                              batch_option=request.get("batch_option", "--per-chip-batch"))
    record_s = time.perf_counter() - t0
    rules = [(p, tuple(s)) for p, s in request.get("rules", [])]
    placements: dict = {}
    offload = bool(request.get("offload_block_inputs"))
    programs = [partition_graph(g, request["mesh"], rules, request.get("batch_axis"), placements, offload,
                                request.get("generation")) for g in recording.graphs]
    return Partitioned(slice=request["slice"], generation=request["generation"], chips=request["chips"],
                       mesh=request["mesh"], blocks_total=recording.blocks_total,
                       blocks_name=recording.blocks_name, programs=programs, placements=placements,
                       record_s=record_s, offload_block_inputs=offload)

