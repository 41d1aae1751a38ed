"""The fast paths PyTorch takes on a PrivateUse1 device in eval mode under no_grad, against the CPU taking the same
paths: `_native_multi_head_attention` (nn.MultiheadAttention), `_transformer_encoder_layer_fwd`
(nn.TransformerEncoderLayer), and nn.TransformerEncoder's nested-tensor path with a padding mask (its zeros at
the padded positions included); nn.Transformer and nn.TransformerDecoder in eval under no_grad."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from support.dispatched import Ops

MHA = torch.ops.aten._native_multi_head_attention.default


@pytest.fixture(autouse=True)
def no_torch_function_mode_left_on():
    """PyTorch takes these fast paths only with no torch-function mode on: a mode an earlier test of the worker left
    on (set_default_device's DeviceContext) would send the CPU reference down the math path. Cleared here and put
    back after."""
    stack = []
    while torch._C._len_torch_function_stack():
        stack.append(torch._C._pop_torch_function_stack())
    yield
    for mode in reversed(stack):
        torch._C._push_on_torch_function_stack(mode)
LAYER = torch.ops.aten._transformer_encoder_layer_fwd.default
B, S, D, HEADS = 3, 6, 8, 2


def _same(a, b, tol=1e-5):
    """Equal NaN positions (a fully masked row gives NaN on the CPU) and values within tol elsewhere."""
    assert a.shape == b.shape
    assert torch.equal(a.isnan(), b.isnan())
    a, b = a.nan_to_num(), b.nan_to_num()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item() < tol


def _x(seed=0):
    return torch.randn(B, S, D, generator=torch.Generator().manual_seed(seed))


def _padding(full_row=False):
    mask = torch.zeros(B, S, dtype=torch.bool)
    mask[1, 4:] = True
    mask[2, 2:] = True
    if full_row:
        mask[2, :] = True
    return mask


def _both(module, *inputs, **kwargs):
    """The module in eval under no_grad on the CPU and on tpu, with the ops each dispatched."""
    results = []
    for device in ("cpu", "tpu"):
        moved = {k: v.to(device) if torch.is_tensor(v) else v for k, v in kwargs.items()}
        module.to(device).eval()
        with torch.no_grad(), Ops() as ops, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the CPU's nested-tensor prototype warning
            out = module(*(x.to(device) for x in inputs), **moved)
        results.append((out, ops.seen))
    module.to("cpu")
    return results


MHA_CASES = {
    "no mask": {},
    "key padding mask": {"key_padding_mask": _padding()},
    "key padding mask, a row that sees nothing": {"key_padding_mask": _padding(full_row=True)},
    "float key padding mask": {"key_padding_mask": torch.zeros(B, S).masked_fill(_padding(), float("-inf"))},
    "causal attn_mask": {"attn_mask": torch.triu(torch.ones(S, S, dtype=torch.bool), 1)},
    "both masks": {"attn_mask": torch.triu(torch.ones(S, S, dtype=torch.bool), 1), "key_padding_mask": _padding()},
    "weights per head": {"average_attn_weights": False},
    "no weights": {"need_weights": False},
}


@pytest.mark.parametrize("case", MHA_CASES)
def test_multi_head_attention_fast_path_matches_the_cpu(case):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(D, HEADS, batch_first=True)
    x = _x()
    (cpu, cpu_ops), (tpu, tpu_ops) = _both(_SelfAttention(mha), x, **MHA_CASES[case])
    assert (MHA in tpu_ops) == (MHA in cpu_ops)  # the same path on both
    assert (MHA in cpu_ops) == (case != "float key padding mask")  # PyTorch's MHA leaves float masks to the math
    assert _same(tpu[0].cpu(), cpu[0])
    if cpu[1] is None:
        assert tpu[1] is None
    else:
        assert _same(tpu[1].cpu(), cpu[1])


class _SelfAttention(nn.Module):
    """The fast path needs query, key and value to be one tensor."""

    def __init__(self, mha):
        super().__init__()
        self.mha = mha

    def forward(self, x, **kwargs):
        return self.mha(x, x, x, **kwargs)


LAYER_CASES = {
    "relu": ({}, {}),
    "gelu, norm first": ({"activation": "gelu", "norm_first": True}, {}),
    "padding mask": ({}, {"src_key_padding_mask": _padding()}),
    "padding mask, a row that sees nothing": ({"norm_first": True}, {"src_key_padding_mask": _padding(True)}),
    "causal src_mask": ({"activation": "gelu"}, {"src_mask": nn.Transformer.generate_square_subsequent_mask(S)}),
}


@pytest.mark.parametrize("case", LAYER_CASES)
def test_encoder_layer_fast_path_matches_the_cpu(case):
    options, kwargs = LAYER_CASES[case]
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(D, HEADS, 16, batch_first=True, **options)
    (cpu, cpu_ops), (tpu, tpu_ops) = _both(layer, _x(), **kwargs)
    assert LAYER in cpu_ops and LAYER in tpu_ops
    assert _same(tpu.cpu(), cpu)


@pytest.mark.parametrize("final_norm", [False, True], ids=["no-norm", "final-norm"])
@pytest.mark.parametrize("full_row", [False, True], ids=["padded", "one-empty-sequence"])
def test_encoder_with_a_padding_mask_gives_the_nested_paths_result(final_norm, full_row):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(D, HEADS, 16, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(D) if final_norm else None,
                                    enable_nested_tensor=True)
    padding = _padding(full_row)
    (cpu, cpu_ops), (tpu, tpu_ops) = _both(encoder, _x(), src_key_padding_mask=padding)
    assert torch.ops.aten._nested_tensor_from_mask.default in cpu_ops  # the CPU took the nested path
    assert tpu_ops.count(LAYER) == 2  # tpu: the layers' fast path, dense
    assert _same(tpu.cpu(), cpu)
    if not final_norm:
        assert (cpu[padding] == 0).all() and (tpu.cpu()[padding] == 0).all()


def test_nested_tensors_on_tpu_say_so_and_an_unaligned_mask_keeps_the_dense_path():
    with pytest.raises(RuntimeError, match="nested tensors are not supported on the tpu device"):
        torch._nested_tensor_from_mask(_x().to("tpu"), _padding().logical_not().to("tpu"))
    unaligned = torch.zeros(B, S, dtype=torch.bool)
    unaligned[0, 1] = True  # padding before a token: PyTorch's mask check declines the nested path
    assert torch._nested_tensor_from_mask_left_aligned(_x(), unaligned.logical_not()) is False
    assert torch._nested_tensor_from_mask_left_aligned(_x().to("tpu"), unaligned.logical_not().to("tpu")) is False
    assert torch._nested_tensor_from_mask_left_aligned(_x().to("tpu"), _padding().logical_not().to("tpu")) is True
    torch.manual_seed(0)
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(D, HEADS, 16, batch_first=True), 2)
    (cpu, cpu_ops), (tpu, _) = _both(encoder, _x(), src_key_padding_mask=unaligned)
    assert torch.ops.aten._nested_tensor_from_mask.default not in cpu_ops
    assert _same(tpu.cpu(), cpu)


def test_transformer_and_decoder_in_eval_under_no_grad_match_the_cpu():
    torch.manual_seed(0)
    model = nn.Transformer(D, HEADS, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=16,
                           batch_first=True)
    src, tgt = _x(1), _x(2)[:, :4]
    causal = nn.Transformer.generate_square_subsequent_mask(4)
    (cpu, _), (tpu, _) = _both(model, src, tgt, tgt_mask=causal, src_key_padding_mask=_padding(),
                               memory_key_padding_mask=_padding())
    assert _same(tpu.cpu(), cpu)
    decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(D, HEADS, 16, batch_first=True), 2)
    (cpu, _), (tpu, _) = _both(decoder, tgt, src, tgt_mask=causal, tgt_is_causal=True)
    assert _same(tpu.cpu(), cpu)


def test_fused_mode_records_the_fast_path_ops():
    torch.manual_seed(0)
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(D, HEADS, 16, batch_first=True), 2,
                                    norm=nn.LayerNorm(D))
    (cpu, _), _ = _both(encoder, _x(), src_key_padding_mask=_padding())
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
        _, (tpu, tpu_ops) = _both(encoder, _x(), src_key_padding_mask=_padding())
        assert tpu_ops.count(LAYER) == 2 and _same(tpu.cpu(), cpu)
