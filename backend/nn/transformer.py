"""nn.TransformerEncoder's nested-tensor fast path on tpu, without nested tensors.

In eval mode under no_grad, with a `src_key_padding_mask`, PyTorch packs the batch into a nested tensor
(`_nested_tensor_from_mask`), runs the layers on it and pads the result back with zeros. A nested tensor
cannot hold a Python device's arrays, so on tpu that op declines with `NestedTensorsOnTpu`, and the encoder
gives the nested path's result the dense way: its layers run with the padding mask (PyTorch's own
`use_nested_tensor=False` path, whose attention ignores the padded keys as the nested one does), the padded
positions are set to zero as `to_padded_tensor(0.0)` sets them, then the final norm, if any, runs. Valid
positions hold the same values either way; the padded ones hold the CPU's zeros (normed, with a norm).

`_nested_tensor_from_mask_left_aligned` (the encoder's mask check) runs on the device, as on the CPU.
"""

from __future__ import annotations

import functools

import torch

_library: torch.library.Library | None = None


class NestedTensorsOnTpu(RuntimeError):
    """A nested tensor was asked for on tpu (PyTorch's nested tensors hold CPU or CUDA memory only)."""


def _nested_from_mask(t, mask, mask_check=True):
    raise NestedTensorsOnTpu("nested tensors are not supported on the tpu device (_nested_tensor_from_mask)")


def _left_aligned(t, mask):
    """True where every row of `mask` (True: a token) is a run of tokens followed only by padding."""
    if mask.dtype != torch.bool:
        raise RuntimeError(f"Expected mask to be of type bool, but got {mask.dtype} instead.")
    if mask.dim() != 2:
        raise RuntimeError("Padding mask should be 2D")
    if t.dim() != 3:
        raise RuntimeError("Input should be a 3D tensor, N * L * D")
    if tuple(t.shape[:2]) != tuple(mask.shape):
        raise RuntimeError("Mask size should match input size")
    lengths = mask.sum(dim=1, keepdim=True)
    positions = torch.arange(mask.shape[1], device=mask.device)
    return bool((mask == (positions < lengths)).all().item())


def _encoder_forward(original):
    @functools.wraps(original)
    def forward(self, src, mask=None, src_key_padding_mask=None, is_causal=None):
        try:
            return original(self, src, mask, src_key_padding_mask, is_causal)
        except NestedTensorsOnTpu:
            pass  # PyTorch chose its nested fast path: the same result, dense
        norm, nested = self.norm, self.use_nested_tensor
        self.norm, self.use_nested_tensor = None, False
        try:
            out = original(self, src, mask, src_key_padding_mask, is_causal)
        finally:
            self.norm, self.use_nested_tensor = norm, nested
        padded = src_key_padding_mask != 0  # True at padding (a float mask: -inf there)
        if not self.layers[0].self_attn.batch_first:
            padded = padded.transpose(0, 1)
        out = out.masked_fill(padded.unsqueeze(-1), 0.0)
        return norm(out) if norm is not None else out

    forward._tpu_agent = True
    return forward


def register() -> None:
    global _library
    if _library is not None:
        return
    _library = torch.library.Library("aten", "IMPL")
    _library.impl("_nested_tensor_from_mask", _nested_from_mask, "AutogradPrivateUse1")
    _library.impl("_nested_tensor_from_mask_left_aligned", _left_aligned, "AutogradPrivateUse1")
    encoder = torch.nn.TransformerEncoder
    if not getattr(encoder.forward, "_tpu_agent", False):
        encoder.forward = _encoder_forward(encoder.forward)
