"""Slices, meshes, placement, replica groups and the cost model: no tracing, no compiling."""

from __future__ import annotations

import pytest

from tpu_agent.errors import InputError
from tpu_agent import slices
from tpu_agent.projection import collectives, cost, placement
from tpu_agent.projection.results import Collective, Partitioned, Traced


def test_slice_names_count_cores_on_v5p_and_chips_on_v6e():
    v5p = slices.parse("v5p-256")
    assert (v5p.generation, v5p.chips, v5p.torus) == ("v5p", 128, (4, 4, 8))
    v6e = slices.parse("v6e-256")
    assert (v6e.chips, v6e.torus, v6e.wraparound) == (256, (16, 16), (True, True))
    assert slices.parse("v5litepod-16").torus == (4, 4)
    assert slices.parse("v5e-16").wraparound == (False, False)  # only the full 16x16 pod wraps around


@pytest.mark.parametrize("bad, words", [("v5e-512", "v5e offers slices of"), ("v9-8", "expected a slice"),
                                        ("v5p-100", "no slice of 50 chips"), ("v5p-7", "not a multiple of 2")])
def test_slices_a_generation_does_not_offer_are_refused_by_name(bad, words):
    with pytest.raises(InputError) as err:
        slices.parse(bad)
    assert words in str(err.value) and bad in str(err.value)


def test_a_mesh_must_multiply_to_the_chip_count():
    assert slices.parse_mesh("data=16,fsdp=16", 256) == {"data": 16, "fsdp": 16}
    with pytest.raises(InputError, match="product is 128, the slice has 256"):
        slices.parse_mesh("data=8,fsdp=16", 256)
    with pytest.raises(InputError, match="NAME=SIZE"):
        slices.parse_mesh("data16", 16)


def test_default_placement_is_fsdp_plus_megatron_tensor_parallel():
    mesh = {"fsdp": 4, "tensor": 2}
    assert placement.default_spec("model.layers.0.mlp.up_proj.weight", (128, 64), mesh) == ("tensor", "fsdp")
    assert placement.default_spec("model.layers.0.mlp.down_proj.weight", (64, 128), mesh) == ("fsdp", "tensor")
    assert placement.default_spec("model.norm.weight", (64,), {"fsdp": 4}) == ("fsdp",)
    assert placement.default_spec("odd", (6,), {"fsdp": 4}) == (None,)  # nothing divides: replicated
    assert placement.batch_spec((32, 16), {"data": 2, "fsdp": 4, "tensor": 2}, None) == (("data", "fsdp"), None)


def test_an_explicit_rule_whose_dim_does_not_divide_names_the_dim_and_axis():
    with pytest.raises(InputError, match=r"w: dim 0 of size 6 does not divide by mesh axis fsdp=4"):
        placement.rule_spec("w", (6, 8), [("w", ("fsdp", None))], {"fsdp": 4})


def test_replica_groups_over_a_named_mesh():
    """This JAX's XLA writes `mesh[...] {axes}`: read as all devices, every collective of a fsdp x tensor mesh
    spanned both axes (FSDP gathers then counted as exposed, tensor all-reduces costed over the whole slice)."""
    text = "replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, use_global_device_ids=true"
    assert collectives.replica_groups(text, 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    text = "replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}, to_apply=%add"
    assert collectives.replica_groups(text, 8) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert collectives.axes_of([0, 4], {"fsdp": 2, "tensor": 4}) == ["fsdp"]


def test_replica_groups_explicit_and_iota():
    assert collectives.replica_groups("replica_groups={{0,1},{2,3}}, dimensions={0}", 4) == [[0, 1], [2, 3]]
    assert collectives.replica_groups("replica_groups=[2,4]<=[8], to_apply=%add", 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert collectives.replica_groups("replica_groups=[4,2]<=[2,4]T(1,0), x=1", 8) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    mesh = {"data": 2, "fsdp": 4}
    assert collectives.axes_of([0, 1, 2, 3], mesh) == ["fsdp"]
    assert collectives.axes_of([0, 4], mesh) == ["data"]
    assert collectives.axes_of(list(range(8)), mesh) == ["data", "fsdp"]


def test_an_all_gather_costs_its_ring_over_the_torus_dims_its_axis_spans():
    sl = slices.parse("v5p-128")  # 64 chips, 4x4x4 torus with wraparound, 90 GB/s per link and direction
    mesh = {"data": 4, "fsdp": 16}  # fsdp: 16 consecutive ids = torus dims 0 and 1
    c = Collective(kind="all-gather", result_bytes=16 * 2**20, group_size=16, groups=4, axes=["fsdp"])
    expected = 16 * 2**20 * 15 / 16 / (2 * 2 * 9e10) + 6 * cost.HOP_LATENCY_S
    assert cost.collective_seconds(c, sl, mesh) == pytest.approx(expected)
    data = c.model_copy(update={"axes": ["data"], "group_size": 4, "groups": 16})
    assert cost._axis_dims(mesh, ["data"], sl.torus) == [2]
    assert cost.collective_seconds(data.model_copy(update={"kind": "all-reduce"}), sl, mesh) == pytest.approx(
        2 * 16 * 2**20 * 3 / 4 / (2 * 9e10) + 3 * cost.HOP_LATENCY_S)


def _program(blocks, dot_flops, collectives_=()):
    return Traced(blocks=blocks, flops=dot_flops, dot_flops=dot_flops, bytes_accessed=0.0, dot_bytes=0.0,
                  argument_bytes=blocks * 2**30, output_bytes=0, alias_bytes=0, temp_bytes=2**40,
                  saved_bytes=2**30, model_flops=dot_flops * 64, collectives=list(collectives_), compile_s=0.0, ops=1)


def test_fsdp_collectives_hide_under_compute_tensor_ones_add_and_blocks_scale_linearly():
    sl = slices.parse("v5p-128")
    gen_peak = 459e12 * cost.MXU_EFFICIENCY["v5p"]
    big = Collective(kind="all-gather", result_bytes=2**20, group_size=16, groups=4, axes=["fsdp"])
    tp = Collective(kind="all-reduce", result_bytes=2**20, group_size=4, groups=16, axes=["tensor"])
    one, two = _program(1, gen_peak * 1.0, [big, tp]), _program(2, gen_peak * 1.5, [big, tp, big, tp])
    part = Partitioned(slice=sl.name, generation="v5p", chips=64, mesh={"tensor": 4, "fsdp": 16}, blocks_total=10,
                       blocks_name="layers", programs=[two, one], placements={})
    p = cost.project(part, sl)
    assert p.compute_s == pytest.approx(1.0 + 9 * 0.5)  # 1 block: 1 s; every further block 0.5 s
    tp_s = cost.collective_seconds(tp, sl, part.mesh)
    assert p.exposed_collective_s == pytest.approx(10 * tp_s)  # fsdp gathers hidden, tensor all-reduces not
    assert p.step_s == pytest.approx(p.compute_s + 10 * tp_s)
    assert p.hbm_bytes_per_chip == pytest.approx(11 * 2**30) and p.fits  # XLA:CPU's temporaries not counted
    assert p.xla_cpu_bytes_per_chip == pytest.approx(10 * 2**30 + 2**40)
    assert p.mfu == pytest.approx(p.model_flops / (p.step_s * 459e12 * 64))


HLO = """HloModule m

ENTRY %main (p0: bf16[4,8], c: s32[]) -> f32[4,8] {
  %p0 = bf16[4,8]{1,0} parameter(0)
  %c = s32[] parameter(1)
  %convert_fusion = f32[4,8]{1,0} convert(%p0)
  %all-gather = f32[16,8]{1,0} all-gather(%convert_fusion), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}
  %all-reduce = f32[16,8]{1,0} all-reduce(%all-gather), channel_id=2, replica_groups={{0,4},{1,5},{2,6},{3,7}}, to_apply=%add
  ROOT %dynamic-slice = f32[8,8]{1,0} dynamic-slice(%all-reduce, %c, %c), dynamic_slice_sizes={8,8}
}
"""


def test_collectives_read_from_hlo_with_cpu_artifacts_undone():
    from tpu_agent.profilers import hlo

    found = collectives.collectives(hlo.parse_module(HLO), {"data": 2, "fsdp": 4})
    gather, reduce = found
    # converted up from bf16 right before it: a TPU gathers bf16
    assert (gather.kind, gather.result_bytes, gather.axes, gather.group_size) == ("all-gather", 16 * 8 * 2, ["fsdp"], 4)
    # sliced to 1/2 by its only consumer: a reduce-scatter of that half (f32: nothing narrows it)
    assert (reduce.kind, reduce.result_bytes, reduce.axes) == ("reduce-scatter", 8 * 8 * 4, ["data"])


def test_the_attention_lowerings_own_traffic_is_not_hbm_traffic():
    """Scores, masks and exponentials stay on chip in a flash kernel: only the rest of the non-dot bytes count."""
    sl = slices.parse("v5e-8")
    program = Traced(blocks=None, flops=0.0, dot_flops=0.0, bytes_accessed=10e9, dot_bytes=2e9, attention_bytes=6e9,
                     argument_bytes=0, output_bytes=0, alias_bytes=0, temp_bytes=0, model_flops=1.0,
                     collectives=[], compile_s=0.0, ops=1)
    part = Partitioned(slice=sl.name, generation="v5e", chips=8, mesh={"fsdp": 8}, blocks_total=None,
                       blocks_name=None, programs=[program], placements={})
    assert cost.project(part, sl).memory_s == pytest.approx(2e9 / 819e9)


def test_conversions_and_collective_buffers_are_not_hbm_traffic():
    """XLA:CPU's f32 conversions of bf16 values and the collectives' buffers leave the non-dot traffic too."""
    sl = slices.parse("v5e-8")
    program = Traced(blocks=None, flops=0.0, dot_flops=0.0, bytes_accessed=10e9, dot_bytes=2e9, attention_bytes=3e9,
                     convert_bytes=2e9, collective_bytes=1e9, argument_bytes=0, output_bytes=0, alias_bytes=0,
                     temp_bytes=0, model_flops=1.0, collectives=[], compile_s=0.0, ops=1)
    part = Partitioned(slice=sl.name, generation="v5e", chips=8, mesh={"fsdp": 8}, blocks_total=None,
                       blocks_name=None, programs=[program], placements={})
    assert cost.project(part, sl).memory_s == pytest.approx(2e9 / 819e9)


SPLIT_HLO = """HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%wide (x: bf16[4,8]) -> f32[4,8] {
  %x = bf16[4,8]{1,0} parameter(0)
  ROOT %c = f32[4,8]{1,0} convert(%x)
}

ENTRY %main (p0: bf16[4,8], p1: f32[8,8]) -> f32[4,8] {
  %p0 = bf16[4,8]{1,0} parameter(0)
  %p1 = f32[8,8]{1,0} parameter(1)
  %widened = f32[4,8]{1,0} fusion(%p0), kind=kLoop, calls=%wide
  %summed = f32[4,8]{1,0} all-reduce(%widened), channel_id=1, replica_groups={{0,1}}, to_apply=%add
  %dot = f32[4,8]{1,0} dot(%summed, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %tanh = f32[4,8]{1,0} tanh(%dot)
}
"""


def test_the_non_dot_split_reads_conversions_and_collectives_from_the_hlo():
    from tpu_agent.profilers import hlo
    from tpu_agent.projection import partition

    scores, converts, moved = partition._non_dot_split(hlo.parse_module(SPLIT_HLO))
    assert (scores, converts, moved) == (0.0, 4 * 8 * (2 + 4), 4 * 8 * (4 + 4))  # the tanh and the dot stay
    # every parameter in bf16: XLA:CPU's f32 all-reduce of a bf16 value moves bf16 on a TPU
    wide, = collectives.collectives(hlo.parse_module(SPLIT_HLO), {"data": 2})
    narrow, = collectives.collectives(hlo.parse_module(SPLIT_HLO), {"data": 2}, narrow=16)
    assert (wide.result_bytes, narrow.result_bytes) == (4 * 8 * 4, 4 * 8 * 2)


def test_a_step_under_its_fsdp_collectives_is_a_floor_the_batch_does_not_move_until_compute_reaches_it():
    """Issue #30 (c): on a tiny model the projected step did not change with --per-chip-batch. Not a bug: the
    FSDP collectives (the weights' gathers, a per-hop latency each) take longer than the chip's compute, and under
    the overlap rule the step is the longer of the two. The batch scales compute; the step moves once compute
    passes the collectives, and the projection names the floor."""
    from tpu_agent.cli import project_view as report

    sl = slices.parse("v5e-4")
    gather = Collective(kind="all-gather", result_bytes=2**10, group_size=4, groups=1, axes=["fsdp"])
    floor = 40 * cost.collective_seconds(gather, sl, {"fsdp": 4})
    peak = 197e12 * cost.MXU_EFFICIENCY["v5e"]

    def step(batch):
        program = _program(1, peak * floor * batch / 8, [gather] * 40)  # compute = floor x batch / 8
        part = Partitioned(slice=sl.name, generation="v5e", chips=4, mesh={"fsdp": 4}, blocks_total=None,
                           blocks_name=None, programs=[program], placements={})
        return part, cost.project(part, sl)

    below = [step(b)[1] for b in (1, 2, 4)]
    assert [p.step_s for p in below] == pytest.approx([floor] * 3)
    assert {p.bound for p in below} == {"overlapped collectives"}
    assert [p.compute_s for p in below] == pytest.approx([floor / 8, floor / 4, floor / 2])
    above = [step(b)[1] for b in (16, 32)]
    assert [p.step_s for p in above] == pytest.approx([2 * floor, 4 * floor])
    assert {p.bound for p in above} == {"compute"}
    part, p = step(1)
    assert "a floor, a larger per-chip batch adds no step time" in report.render(part, p)


@pytest.mark.parametrize("target, chips, how", [
    ("v7x-128", None, "the generation's name, counting TensorCores"),
    ("tpu7x-4x4x4", None, "a chip topology"),
    ("v7x", 64, "a chip count"),
])
def test_a_v7x_slice_is_read_three_ways_and_says_how(target, chips, how):
    """2 TensorCores per chip, each a JAX device: v7x-128 = tpu7x-4x4x4 = 64 chips."""
    sl = slices.read(target, chips)
    assert (sl.name, sl.chips, sl.cores, sl.torus) == ("v7x-128", 64, 128, (4, 4, 4))
    assert how in sl.read_as and "64 chips, 128 TensorCores (2 per chip, each a JAX device)" in sl.read_as


def test_a_topology_keeps_its_shape_and_conflicting_sizes_are_refused():
    assert slices.read("tpu7x-4x8x8").torus == (4, 8, 8) and slices.read("tpu7x-4x8x8").chips == 256
    assert slices.read("v6e-16x16").chips == 256
    with pytest.raises(InputError, match="v7x slices are 3-D"):
        slices.read("tpu7x-8x8")
    with pytest.raises(InputError, match="has 64 chips, --chips says 32"):
        slices.read("tpu7x-4x4x4", 32)


def test_across_slices_only_the_data_axis_runs_and_the_gradients_cross_dcn():
    sl = slices.multislice(slices.read("tpu7x-2x2x2"), 4)
    assert (sl.chips, sl.slices, sl.total_chips) == (8, 4, 32)
    assert slices.in_slice_mesh({"data": 8, "fsdp": 4}, sl) == {"data": 2, "fsdp": 4}
    with pytest.raises(InputError, match="only the data axis runs over DCN"):
        slices.in_slice_mesh({"data": 2, "fsdp": 16}, sl)
    program = _program(1, 0.0).model_copy(update={"param_bytes": 2**30, "model_flops": 1.0})
    part = Partitioned(slice=sl.name, generation="v7x", chips=8, mesh={"fsdp": 8}, blocks_total=None,
                       blocks_name=None, programs=[program], placements={})
    p = cost.project(part, sl, {"data": 4, "fsdp": 8})
    dcn = 2 * 2**30 * 3 / 4 / 1.25e10 + 3 * cost.DCN_LATENCY_S  # a ring over 4 slices at DCN bandwidth per chip
    assert p.step_s == pytest.approx(dcn) and p.bound == "overlapped collectives"
    assert p.chips == 32 and p.mesh == {"data": 4, "fsdp": 8} and p.model_flops == 4.0


def test_offloaded_block_inputs_leave_hbm_and_their_copies_hide_under_compute():
    sl = slices.read("v7x-128")
    peak = 2307e12 * cost.MXU_EFFICIENCY["v7x"]
    host = 64 * 2**30  # 4 s over a 32 GB/s host link, both ways

    def projected(compute_s):
        program = _program(1, peak * compute_s).model_copy(update={"host_saved_bytes": host})
        part = Partitioned(slice=sl.name, generation="v7x", chips=64, mesh={"fsdp": 64}, blocks_total=None,
                           blocks_name=None, programs=[program], placements={}, offload_block_inputs=True)
        return cost.project(part, sl)

    hidden, exposed = projected(10.0), projected(1.0)
    assert hidden.host_transfer_s == pytest.approx(2 * host / 3.2e10)
    assert hidden.step_s == pytest.approx(10.0) and hidden.host_offload_bytes_per_chip == host
    assert hidden.hbm_bytes_per_chip == pytest.approx(2 * 2**30)  # arguments + the saved that stayed in HBM
    assert exposed.step_s == pytest.approx(hidden.host_transfer_s) and exposed.bound == "host offload"
    assert hidden.estimate is True and any("host memory" in a for a in hidden.assumptions)
    assert hidden.memory_margin_bytes == pytest.approx(192 * 2**30 - 2 * 2**30)


def test_a_plan_left_out_for_memory_says_by_how_much():
    from tpu_agent.projection import rank

    plans = {}

    def project(plan):
        fits = plan.checkpoint
        projected = rank.ProjectedPlan(plan=plan, global_batch=64, step_s=1.0 if fits else 0.8,
                                       time_per_sample_s=(1.0 if fits else 0.8) / 64, mfu=0.5,
                                       memory_per_chip_bytes=(20 if fits else 40) * 2**30, hbm_bytes=32 * 2**30,
                                       fits=fits, assumptions=["an assumption"])
        plans[plan.key()] = projected
        return projected, 4

    ranking = rank.rank(slices.read("v6e-64"), project, script_batch=64 * 64, budget=3)
    assert ranking.estimate is True and ranking.after.plan.checkpoint
    assert ranking.after.estimate is True and ranking.after.assumptions == ["an assumption"]
    assert rank.fit_text(ranking.after) == "fits, 12 GiB free"
    assert any("left out for memory: does not fit: 8 GiB over of 32 GiB" in n for n in ranking.notes), ranking.notes


def test_a_value_saved_under_two_names_is_one_buffer():
    """An attention output saved by the attention and, detached or viewed, by activation checkpointing is one
    buffer on a device: counted once in the activations saved for backward."""
    import jax
    import jax.numpy as jnp
    import torch

    from tpu_agent.projection import lower
    from tpu_agent.projection.record import Graph, Node, Ref

    aten = torch.ops.aten
    nodes = [Node(aten.relu.default, (Ref(1),), {}, [2], [], [(4, 8)]),
             Node(aten.detach.default, (Ref(2),), {}, [3], [], [(4, 8)]),
             Node(aten.t.default, (Ref(3),), {}, [4], [], [(8, 4)]),
             Node(aten.exp.default, (Ref(1),), {}, [5], [], [(4, 8)]),
             Node(aten.mul.Tensor, (Ref(2), Ref(5)), {}, [6], [], [(4, 8)], backward=True),
             Node(aten.mm.default, (Ref(4), Ref(6)), {}, [7], [], [(8, 8)], backward=True)]
    graph = Graph(nodes, {1: ((4, 8), torch.float32, "data", None)}, [7], block_inputs={2})
    fn = lower.Lowered(graph)
    jax.eval_shape(fn, jax.ShapeDtypeStruct((4, 8), jnp.float32))
    assert sorted((shape, block) for shape, _size, _dim, block in fn.saved) == [((4, 8), False), ((4, 8), True)]


def test_tune_takes_a_topology_as_its_target():
    from tpu_agent.config import TuneOptions

    options = TuneOptions(target="tpu7x-4x4x4")
    assert (options.slice, options.generation) == ("tpu7x-4x4x4", "v7x")


def test_the_optimizers_modules_are_found_beside_a_dead_weak_proxy():
    """The recorder finds the optimizer's modules among every live object; a weakref.proxy whose referent died is
    one of them (the fresh-clone suite met one), and isinstance on it raises ReferenceError."""
    import weakref

    import torch

    from tpu_agent.projection import record

    class Referent:
        pass

    referent = Referent()
    dead = weakref.proxy(referent)
    del referent
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    holder = [dead]  # a container gc tracks, so the proxy is among gc.get_objects()
    assert record._modules_of(optimizer) == [model]
    assert holder
