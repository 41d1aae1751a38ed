"""HLO text analysis: instructions, shapes, FLOPs and the aten op / source line behind each op."""

from __future__ import annotations

import pytest

from tpu_agent.profilers import hlo

HLO = """\
HloModule jit_graph, is_scheduled=true, entry_computation_layout={(f32[127,1023]{1,0}, f32[2047,1023]{1,0})->(f32[127,2047]{1,0}, f32[])}

%fused_computation.6 (param_0.1: f32[127,1023], param_1.1: f32[2047,1023]) -> f32[127,2047] {
  %param_0.1 = f32[127,1023]{1,0} parameter(0)
  %param_1.1 = f32[2047,1023]{1,0} parameter(1)
  ROOT %dot_general.0 = f32[127,2047]{1,0} dot(%param_0.1, %param_1.1), lhs_contracting_dims={1}, rhs_contracting_dims={1}, metadata={op_name="jit(graph)/aten.addmm.default[train.py:18]/dot_general" stack_frame_id=23}
}

%region_0.1 (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add.1 = f32[] add(%a, %b)
}

%fused_computation.7 (param_0.2: f32[127,2047]) -> f32[127,2047] {
  %param_0.2 = f32[127,2047]{1,0} parameter(0)
  %multiply.3 = f32[127,2047]{1,0} multiply(%param_0.2, %param_0.2), metadata={op_name="jit(graph)/aten.gelu.default[train.py:19]/mul"}
  ROOT %tanh.2 = f32[127,2047]{1,0} tanh(%multiply.3)
}

ENTRY %main.9 (x: f32[127,1023], w: f32[2047,1023]) -> (f32[127,2047], f32[]) {
  %x = f32[127,1023]{1,0} parameter(0)
  %w = f32[2047,1023]{1,0} parameter(1)
  %ynn_fusion.6 = f32[127,2047]{1,0} fusion(%x, %w), kind=kCustom, calls=%fused_computation.6, metadata={op_name="jit(graph)/aten.addmm.default[train.py:18]/dot_general" stack_frame_id=23}, backend_config={"fusion_config":{"kind":"__ynn_fusion"}}
  %act = f32[127,2047]{1,0} fusion(%ynn_fusion.6), kind=kLoop, calls=%fused_computation.7
  %c = f32[] constant(0)
  %sum = f32[] reduce(%act, %c), dimensions={0,1}, to_apply=%region_0.1
  %img = f32[8,32,32,3]{3,2,1,0} parameter(2)
  %k = f32[3,3,3,16]{3,2,1,0} parameter(3)
  %conv = f32[8,32,32,16]{3,2,1,0} convolution(%img, %k), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_01io->b01f, metadata={op_name="jit(graph)/aten.convolution.default[cnn.py:31]/conv_general_dilated"}
  ROOT %out = (f32[127,2047]{1,0}, f32[]) tuple(%act, %sum)
}
"""


def test_parses_computations_and_instructions():
    module = hlo.parse_module(HLO)
    assert module.entry == "main.9"
    assert set(module.computations) == {"fused_computation.6", "region_0.1", "fused_computation.7", "main.9"}
    insts = module.instruction_map("main.9")
    assert insts["ynn_fusion.6"].operands == ["x", "w"]
    assert insts["ynn_fusion.6"].called == ["fused_computation.6"]
    assert insts["ynn_fusion.6"].attr("kind") == "kCustom"
    assert [str(a) for a in insts["out"].shape] == ["f32[127,2047]", "f32[]"]
    assert insts["conv"].attr("dim_labels") == "b01f_01io->b01f"


def test_origin_reads_the_aten_op_and_source_line():
    assert hlo.origin("jit(graph)/aten.mm.default[train.py:42]/dot_general") == ("aten.mm.default", "train.py:42")
    assert hlo.origin("jit(graph)/aten.t.default[a.py:1]/transpose(jvp(aten.mm.default[b.py:2]))") == ("aten.mm.default", "b.py:2")
    assert hlo.origin("jit(run)/dot_general") == (None, None)
    assert hlo.origin(None) == (None, None)


def test_hot_ops_with_flops_shapes_and_origin():
    ops = {op.name: op for op in hlo.hot_ops(hlo.parse_module(HLO))}
    assert set(ops) == {"ynn_fusion.6", "act", "conv"}
    dot = ops["ynn_fusion.6"]
    assert dot.flops == 2 * 127 * 2047 * 1023
    assert (dot.aten_op, dot.source, dot.fusion_kind) == ("aten.addmm.default", "train.py:18", "kCustom")
    (c,) = dot.contractions
    assert (str(c.lhs), str(c.rhs), c.dot_dims["lhs_contracting"]) == ("f32[127,1023]", "f32[2047,1023]", (1,))
    # multiply counts one flop per element; tanh is a transcendental (not a flop, as in XLA).
    assert ops["act"].flops == 127 * 2047
    assert ops["act"].contractions == []
    conv = ops["conv"]
    assert conv.flops == 2 * (8 * 32 * 32 * 16) * 9 * 3
    assert conv.contractions[0].conv == {"out_batch": 8, "out_spatial": (32, 32), "in_features": 3,
                                         "out_features": 16, "window": (3, 3), "groups": 1}
    assert (conv.aten_op, conv.source) == ("aten.convolution.default", "cnn.py:31")


def test_flops_of_a_real_xla_program_match_its_cost_analysis():
    import jax
    import jax.numpy as jnp

    def f(x, w1, w2):
        return jnp.tanh(x @ w1) @ w2 + 1.0

    args = (jnp.ones((127, 1023)), jnp.ones((1023, 2047)), jnp.ones((2047, 10)))
    compiled = jax.jit(f).lower(*args).compile()
    module = hlo.parse_module(compiled.as_text())
    dots = [c for op in hlo.hot_ops(module) for c in op.contractions]
    assert sorted(c.flops for c in dots) == [2 * 127 * 2047 * 10, 2 * 127 * 1023 * 2047]
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    assert hlo.computation_flops(module, module.entry) == pytest.approx(cost["flops"], rel=0.01)


def test_unknown_lines_are_skipped():
    module = hlo.parse_module("HloModule m\n\nENTRY %e () -> f32[] {\n  garbage line\n  ROOT %c = f32[] constant(1)\n}\n")
    assert [i.opcode for i in module.computations["e"]] == ["constant"]
    assert hlo.hot_ops(module) == []


def _convs(fn, *args):
    import jax

    compiled = jax.jit(fn).lower(*args).compile()
    convs = [c for op in hlo.hot_ops(hlo.parse_module(compiled.as_text())) for c in op.contractions]
    return compiled.cost_analysis()["flops"], convs


@pytest.mark.parametrize("stride,pad", [(1, 1), (2, 1), (2, 0), (1, 2)])
def test_conv_padding_flops_match_xla_cost_analysis(stride, pad):
    """XLA counts only the kernel positions that meet real input; the HLO windows give the rest."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    def conv(x, w):
        return lax.conv_general_dilated(x, w, (stride, stride), [(pad, pad)] * 2,
                                        dimension_numbers=("NCHW", "OIHW", "NCHW"))

    x, w = jnp.ones((4, 7, 9, 9), jnp.float32), jnp.ones((5, 7, 3, 3), jnp.float32)
    xla, (forward,) = _convs(conv, x, w)
    assert (forward.padding_flops > 0) == (pad > 0)
    assert xla == pytest.approx(forward.flops - forward.padding_flops, rel=1e-6)
    # Forward, input and weight gradients (lhs-dilated for stride 2): the rest of XLA's count is the square
    # and the sums, a few FLOPs per element.
    xla, convs = _convs(jax.grad(lambda x, w: jnp.sum(conv(x, w) ** 2), argnums=(0, 1)), x, w)
    assert len(convs) == 3 and all(c.kind == "convolution" for c in convs)
    assert xla == pytest.approx(sum(c.flops - c.padding_flops for c in convs), rel=0.02)
