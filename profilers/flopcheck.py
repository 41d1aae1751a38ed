"""PyTorch's own FLOP count of a region, to cross-check XLA's.

FlopCounterMode counts matmuls, convolutions and attention from aten shapes;
XLA counts every arithmetic op of the programs it ran. On the same region
they must agree closely unless elementwise work is large; the explanation
says which of the known differences applies.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode, _FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from .schema import FlopCheck

aten = torch.ops.aten
_METADATA_OPS = {
    aten.sym_is_contiguous.default, aten.is_contiguous.default, aten.is_contiguous.memory_format,
    aten.is_strides_like_format.default, aten.is_non_overlapping_and_dense.default, aten.size.default,
    aten.sym_size.default, aten.stride.default, aten.sym_stride.default, aten.storage_offset.default,
    aten.sym_storage_offset.default, aten.numel.default, aten.sym_numel.default, aten.dim.default,
    torch.ops.prim.layout.default,
}

TOLERANCE = 0.10


def _on_tpu(value) -> bool:
    if isinstance(value, torch.Tensor):
        return value.device.type == "tpu"
    if isinstance(value, (list, tuple)):
        return any(_on_tpu(v) for v in value)
    if isinstance(value, dict):
        return any(_on_tpu(v) for v in value.values())
    return False


class _CountingMode(_FlopCounterMode):
    """FlopCounterMode's dispatch without its own decompositions.

    FlopCounterMode re-decomposes ops it has no formula for; on the tpu device
    some of those decompositions (batch norm's) break the script. Ops are left
    to the device, which sees the same aten ops; every op with a FLOP formula
    (mm, addmm, bmm, convolution and their backwards, attention) is counted.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA_OPS:
            return NotImplemented
        if isinstance(func, torch._ops.HigherOrderOperator):
            return self._handle_higher_order_ops(func, types, args, kwargs)
        out = func(*args, **kwargs)
        return self.counter._count_flops(func._overloadpacket, out, args, kwargs)


def _four_d(shape):
    return (1, *shape) if len(shape) == 3 else shape


def _attention_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(_four_d(query_shape), _four_d(key_shape), _four_d(value_shape))


def _attention_backward_flop(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(*(_four_d(s) for s in (grad_out_shape, query_shape, key_shape, value_shape)))


class TpuFlopCounter(FlopCounterMode):
    """FlopCounterMode for one region of a script: ops on `tpu` tensors only (not the
    script's CPU data preparation), no module hooks installed in the user's model."""

    def __init__(self) -> None:
        # The device's attention op (backend/nn/attention.py) is counted as PyTorch counts its fused ones.
        super().__init__(display=False, custom_mapping={
            aten._scaled_dot_product_fused_attention_overrideable: _attention_flop,
            aten._scaled_dot_product_fused_attention_overrideable_backward: _attention_backward_flop,
        })

    def __enter__(self):
        self.flop_counts.clear()
        self.mode = _CountingMode(self)
        self.mode.__enter__()
        return self

    def __exit__(self, *args):
        mode, self.mode = self.mode, None
        if mode is not None:
            mode.__exit__(*args)
        return False

    def _count_flops(self, func_packet, out, args, kwargs):
        if _on_tpu(args) or _on_tpu(kwargs) or _on_tpu(out):
            return super()._count_flops(func_packet, out, args, kwargs)
        return out

    def by_op(self) -> dict[str, float]:
        counts = self.get_flop_counts().get("Global", {})
        return {str(op): float(n) for op, n in counts.items()}


def compare(region: str, xla_flops: float, xla_dot_conv_flops: float, counter_flops: float,
            by_op: dict[str, float], conv_padding_flops: float = 0.0) -> FlopCheck:
    """XLA's total against FlopCounterMode's, with the reasons they differ.

    XLA's cost analysis counts only the convolution multiply-adds that meet real
    input elements; FlopCounterMode counts every kernel position. The
    padding's share is computed from the HLO windows and given back to XLA's
    total before the two are compared.
    """
    if counter_flops <= 0:
        return FlopCheck(
            region=region, xla_flops=xla_flops, xla_dot_conv_flops=xla_dot_conv_flops,
            flop_counter_flops=counter_flops, flop_counter_by_op=by_op,
            relative_difference=0.0 if xla_flops == 0 else None, agrees=xla_flops == 0,
            explanation="FlopCounterMode counted no matmul or convolution on the tpu device in this region"
            + ("" if xla_flops == 0 else "; XLA's FLOPs are all elementwise work it does not count"),
        )
    if xla_flops <= 0:  # not a disagreement of two counts: nothing compiled ran the matmuls
        return FlopCheck(
            region=region, xla_flops=xla_flops, xla_dot_conv_flops=xla_dot_conv_flops,
            flop_counter_flops=counter_flops, flop_counter_by_op=by_op, relative_difference=-1.0, agrees=False,
            explanation="no XLA program that ran in this region did the matmuls FlopCounterMode saw dispatched "
            "(fused execution runs them only when a value is read back), so XLA counted none",
        )
    rel = xla_flops / counter_flops - 1.0
    adjusted = (xla_flops + conv_padding_flops) / counter_flops - 1.0
    dot_rel = xla_dot_conv_flops / counter_flops - 1.0 if xla_dot_conv_flops else None
    other = xla_flops + conv_padding_flops - xla_dot_conv_flops
    reasons = []
    if conv_padding_flops > 0 and xla_flops > 0:
        reasons.append(f"XLA leaves out the convolutions' multiply-adds against zero padding "
                       f"({conv_padding_flops:.3g} FLOP, {conv_padding_flops / counter_flops:.1%} of FlopCounterMode's "
                       f"count), which FlopCounterMode counts; with them given back the totals differ by {adjusted:+.1%}")
    if other > 0 and xla_flops > 0:
        share = other / (xla_flops + conv_padding_flops)
        reasons.append(f"XLA also counts elementwise and reduction work ({share:.1%} of its total), "
                       "which FlopCounterMode ignores")
    if dot_rel is not None and abs(dot_rel) <= 0.01 and abs(adjusted) > 0.01:
        reasons.append(f"on dots and convolutions alone the two agree ({dot_rel:+.1%})")
    if dot_rel is not None and abs(dot_rel) > 0.01:
        has_conv = any("convolution" in op for op in by_op)
        if has_conv:
            reasons.append(f"on dots and convolutions alone the two differ by {dot_rel:+.1%}: FlopCounterMode "
                           "counts a convolution backward as 2x the forward per needed gradient, while XLA counts "
                           "the kernel positions of the convolutions it actually emits (padding included)")
        else:
            reasons.append(f"on dots alone the two differ by {dot_rel:+.1%}: fused-away or recomputed matmuls "
                           "(XLA) and ops PyTorch decomposes differently (FlopCounterMode)")
    if not reasons:
        reasons.append("both count the same matmuls")
    return FlopCheck(
        region=region, xla_flops=xla_flops, xla_dot_conv_flops=xla_dot_conv_flops,
        flop_counter_flops=counter_flops, flop_counter_by_op=by_op, relative_difference=rel,
        dot_conv_relative_difference=dot_rel, xla_conv_padding_flops=conv_padding_flops,
        adjusted_relative_difference=adjusted, agrees=abs(adjusted) <= TOLERANCE,
        dot_conv_agrees=dot_rel is not None and abs(dot_rel) <= TOLERANCE, tolerance=TOLERANCE,
        explanation="; ".join(reasons),
    )
