"""`nn.LSTM`, `nn.GRU` and `nn.RNN` on tpu run a whole sequence as one op, forward and backward.

PyTorch's `aten::lstm`, `gru`, `rnn_tanh` and `rnn_relu` are composite on a PrivateUse1 device: a loop over
layers and time steps in C++, a handful of ops per step (the LSTM and GRU steps through `_thnn_fused_*_cell`,
as on CUDA), so a sequence of T steps was T small programs in eager mode and a graph growing with T in fused
mode. Their autograd kernels for PrivateUse1 send them instead to `tpu_agent::rnn` (or `rnn_dropout`, with
dropout between layers in training) and its backward `tpu_agent::rnn_backward`, lowered in
ops/recurrent.py as one `lax.scan` per layer and direction. Padded input (`.input`, batch_first or not) and
packed sequences (`.data`, from `pack_padded_sequence`, whose own op is routed here too) both take that path. The cells (`nn.LSTMCell`...) keep
PyTorch's path: one fused cell op per call.
"""

from __future__ import annotations

import torch

_library: torch.library.Library | None = None

MODES = {"lstm": "LSTM", "gru": "GRU", "rnn_tanh": "RNN_TANH", "rnn_relu": "RNN_RELU"}


class _Sequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, statics, input, hx, cx, *params):
        mode, num_layers, has_biases, dropout, train, bidirectional, batch_first, batch_sizes = statics
        ops = _ops()
        shared = (mode, num_layers, has_biases, bidirectional, batch_first, batch_sizes)
        seed = None
        if train and dropout > 0 and num_layers > 1:
            output, hy, cy, seed = ops.rnn_dropout(input, list(params), hx, cx, *shared, float(dropout))
        else:
            output, hy, cy = ops.rnn(input, list(params), hx, cx, *shared)
            dropout = 0.0
        ctx.shared, ctx.dropout, ctx.lstm = shared, float(dropout), cx is not None
        ctx.save_for_backward(input, hx, cx, seed, *params)
        if cx is None:
            ctx.mark_non_differentiable(cy)
        return output, hy, cy

    @staticmethod
    @torch.autograd.function.once_differentiable  # a second derivative says so, as PyTorch's own such ops do
    def backward(ctx, grad_output, grad_hy, grad_cy):
        input, hx, cx, seed, *params = ctx.saved_tensors
        grad_input, grad_params, grad_hx, grad_cx = _ops().rnn_backward(
            grad_output, grad_hy, grad_cy if ctx.lstm else None, input, params, hx, cx, seed, *ctx.shared,
            ctx.dropout)
        return (None, grad_input, grad_hx, grad_cx if ctx.lstm else None, *grad_params)


def _ops():
    from ..ops import recurrent  # noqa: F401  (defines the tpu_agent:: ops and their lowerings)

    return torch.ops.tpu_agent


def _run(mode, input, batch_sizes, hx, cx, params, has_biases, num_layers, dropout, train, bidirectional,
         batch_first):
    if batch_sizes is not None:
        batch_sizes = [int(n) for n in batch_sizes.tolist()]
    if torch.is_autocast_enabled("tpu"):  # as CUDA's autocast runs cuDNN's RNN: in the autocast dtype
        input, hx, cx, params = _autocast(input, hx, cx, params)
    statics = (mode, int(num_layers), bool(has_biases), float(dropout), bool(train), bool(bidirectional),
               bool(batch_first), batch_sizes)
    return _Sequence.apply(statics, input, hx, cx, *params)


def _autocast(input, hx, cx, params):
    dtype = torch.get_autocast_dtype("tpu")

    def cast(t):
        return t.to(dtype) if t is not None and t.is_floating_point() and t.dtype != torch.float64 else t

    return cast(input), cast(hx), cast(cx), [cast(p) for p in params]


def _lstm_input(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
    return _run("LSTM", input, None, hx[0], hx[1], params, has_biases, num_layers, dropout, train, bidirectional,
                batch_first)


def _lstm_data(data, batch_sizes, hx, params, has_biases, num_layers, dropout, train, bidirectional):
    return _run("LSTM", data, batch_sizes, hx[0], hx[1], params, has_biases, num_layers, dropout, train,
                bidirectional, False)


def _one_state(mode):
    def padded(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
        output, hy, _ = _run(mode, input, None, hx, None, params, has_biases, num_layers, dropout, train,
                             bidirectional, batch_first)
        return output, hy

    def packed(data, batch_sizes, hx, params, has_biases, num_layers, dropout, train, bidirectional):
        output, hy, _ = _run(mode, data, batch_sizes, hx, None, params, has_biases, num_layers, dropout, train,
                             bidirectional, False)
        return output, hy

    return padded, packed


def _pack_padded_sequence(input, lengths, batch_first):
    """`pack_padded_sequence`'s op (CompositeExplicitAutograd, which a Python device's tensors do not reach):
    the batch sizes per step computed on the CPU from the CPU lengths, as PyTorch does, and the packed rows one
    `index_select` on the device (whose backward scatters the gradient back into the padded block)."""
    if lengths.device.type != "cpu" or lengths.dim() != 1 or lengths.dtype != torch.int64:
        raise RuntimeError(f"'lengths' argument should be a 1D CPU int64 tensor, but got {lengths.dim()}D "
                           f"{lengths.device} {lengths.dtype} tensor")
    padded = input.transpose(0, 1) if batch_first else input
    batch = padded.shape[1]
    if input.numel() == 0:
        raise RuntimeError("Cannot pack empty tensors.")
    sizes = lengths.tolist()
    if len(sizes) != batch:
        raise RuntimeError(f"Expected `len(lengths)` to be equal to batch_size, but got {len(sizes)} "
                           f"(batch_size={batch})")
    if sizes[-1] <= 0:
        raise RuntimeError("Length of all samples has to be greater than 0, but found an element in 'lengths' "
                           "that is <= 0")
    if any(a < b for a, b in zip(sizes, sizes[1:])):
        raise RuntimeError("`lengths` array must be sorted in decreasing order when `enforce_sorted` is True. You "
                           "can pass `enforce_sorted=False` to pack_padded_sequence and/or pack_sequence to "
                           "sidestep this requirement if you do not need ONNX exportability.")
    if sizes[0] > padded.shape[0]:
        raise RuntimeError(f"a length ({sizes[0]}) is longer than the padded sequences ({padded.shape[0]})")
    batch_sizes = [sum(1 for n in sizes if n > t) for t in range(sizes[0])]
    rows = torch.tensor([t * batch + b for t, n in enumerate(batch_sizes) for b in range(n)], dtype=torch.int64)
    data = padded.flatten(0, 1).index_select(0, rows.to(input.device))
    return data, torch.tensor(batch_sizes, dtype=torch.int64)


def register() -> None:
    global _library
    if _library is not None:
        return
    _library = torch.library.Library("aten", "IMPL")
    _library.impl("lstm.input", _lstm_input, "AutogradPrivateUse1")
    _library.impl("lstm.data", _lstm_data, "AutogradPrivateUse1")
    for name in ("gru", "rnn_tanh", "rnn_relu"):
        padded, packed = _one_state(MODES[name])
        _library.impl(f"{name}.input", padded, "AutogradPrivateUse1")
        _library.impl(f"{name}.data", packed, "AutogradPrivateUse1")
    _library.impl("_pack_padded_sequence", _pack_padded_sequence, "AutogradPrivateUse1")
