"""Recurrent layers: LSTM, GRU and Elman RNN (tanh, relu) as whole sequences, and PyTorch's fused cells.

A sequence runs as one program: each layer and direction is a `lax.scan` over time, the input projection of
the whole sequence computed before it as one matmul (as PyTorch's CPU path does). `tpu_agent::rnn` is the
forward, `tpu_agent::rnn_dropout` the same with dropout between layers (a random op: its key leaves in the
`seed` output and the backward redraws the same masks from it), `tpu_agent::rnn_backward` the gradients
(`jax.vjp` of the forward, in one program). backend/nn/recurrent.py routes `aten::lstm`, `gru`, `rnn_tanh` and
`rnn_relu` (padded and packed) to them.

Packed sequences (`pack_padded_sequence`) arrive as the packed rows and their batch sizes per step: the rows
are gathered into a padded [T, B] block, and a sequence's state stops changing past its length, so the final
states are those of each sequence's last step and the reverse direction starts at each sequence's own end.

`_thnn_fused_lstm_cell` and `_thnn_fused_gru_cell` (what `nn.LSTMCell` and `nn.GRUCell` call on a
PrivateUse1 device, as on CUDA) and their backward ops are lowered with CUDA's workspace layouts:
the activated gates (i, f, g, o) for the LSTM cell, (r, z, n, hx, the hidden side of n) for the GRU cell.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from ..core.registry import lower
from .attention import _key, _seed

aten = torch.ops.aten

_SHARED = ("str mode, int num_layers, bool has_biases, bool bidirectional, bool batch_first, int[]? batch_sizes")
SCHEMAS = {
    "rnn": f"rnn(Tensor input, Tensor[] params, Tensor hx, Tensor? cx, {_SHARED}) -> (Tensor, Tensor, Tensor)",
    "rnn_dropout": (f"rnn_dropout(Tensor input, Tensor[] params, Tensor hx, Tensor? cx, {_SHARED}, float dropout)"
                    " -> (Tensor, Tensor, Tensor, Tensor)"),
    "rnn_backward": ("rnn_backward(Tensor grad_output, Tensor grad_hy, Tensor? grad_cy, Tensor input, Tensor[] params, "
                     f"Tensor hx, Tensor? cx, Tensor? seed, {_SHARED}, float dropout) "
                     "-> (Tensor, Tensor[], Tensor, Tensor)"),
}
_library = None


def define() -> None:
    """The `tpu_agent::` ops' schemas (no kernel: they reach the device's dispatch, which lowers them)."""
    global _library
    if _library is not None or hasattr(torch.ops.tpu_agent, "rnn"):
        return
    _library = torch.library.Library("tpu_agent", "DEF")
    for schema in SCHEMAS.values():
        _library.define(schema)


define()

GATES = {"LSTM": 4, "GRU": 3, "RNN_TANH": 1, "RNN_RELU": 1}


# --------------------------------------------------------------------------
# one step of each cell, on the precomputed input side `xw` (input @ w_ih.T + b_ih)
# --------------------------------------------------------------------------


def _hidden_side(h, w_hh, b_hh):
    out = h @ w_hh.T
    return out if b_hh is None else out + b_hh


def _lstm_step(carry, xw, w_hh, b_hh, w_hr):
    h, c = carry
    i, f, g, o = jnp.split(xw + _hidden_side(h, w_hh, b_hh), 4, axis=-1)
    c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
    h = jax.nn.sigmoid(o) * jnp.tanh(c)
    if w_hr is not None:
        h = h @ w_hr.T
    return (h, c), h


def _gru_step(carry, xw, w_hh, b_hh, w_hr):
    (h,) = carry
    x_r, x_z, x_n = jnp.split(xw, 3, axis=-1)
    h_r, h_z, h_n = jnp.split(_hidden_side(h, w_hh, b_hh), 3, axis=-1)
    r = jax.nn.sigmoid(x_r + h_r)
    z = jax.nn.sigmoid(x_z + h_z)
    n = jnp.tanh(x_n + r * h_n)
    h = (1 - z) * n + z * h
    return (h,), h


def _elman_step(activation):
    def step(carry, xw, w_hh, b_hh, w_hr):
        (h,) = carry
        h = activation(xw + _hidden_side(h, w_hh, b_hh))
        return (h,), h

    return step


STEPS = {"LSTM": _lstm_step, "GRU": _gru_step, "RNN_TANH": _elman_step(jnp.tanh),
         "RNN_RELU": _elman_step(jax.nn.relu)}


# --------------------------------------------------------------------------
# a whole sequence
# --------------------------------------------------------------------------


def _unpack(params, mode, num_layers, has_biases, directions):
    """The flat parameter list as (w_ih, w_hh, b_ih, b_hh, w_hr) per layer and direction."""
    per = len(params) // (num_layers * directions)
    base = 4 if has_biases else 2
    if per not in (base, base + 1) or (per == base + 1 and mode != "LSTM"):
        raise RuntimeError(f"{mode}: got {len(params)} parameters for {num_layers} layers x {directions} "
                           f"directions, has_biases={has_biases}")
    out = []
    for k in range(num_layers * directions):
        group = list(params[k * per:(k + 1) * per])
        w_ih, w_hh = group[0], group[1]
        b_ih, b_hh = (group[2], group[3]) if has_biases else (None, None)
        w_hr = group[base] if per == base + 1 else None
        out.append((w_ih, w_hh, b_ih, b_hh, w_hr))
    return out


def _packed_layout(batch_sizes):
    """Static gathers between packed rows and a padded [T, B] block, and the block's validity mask."""
    sizes = np.asarray(batch_sizes, np.int64)
    steps, batch = len(sizes), int(sizes[0])
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    valid = np.arange(batch)[None, :] < sizes[:, None]  # [T, B]
    rows = np.where(valid, offsets[:, None] + np.arange(batch)[None, :], 0)
    flat = np.nonzero(valid.reshape(-1))[0]  # padded positions (t * B + b) in packed order
    return rows, valid, flat, steps, batch


def _direction(x, valid, carry, p, mode, reverse):
    w_ih, w_hh, b_ih, b_hh, w_hr = p
    xw = jnp.einsum("tbi,gi->tbg", x, w_ih)
    if b_ih is not None:
        xw = xw + b_ih
    cell = STEPS[mode]

    def step(state, inputs):
        xw_t, valid_t = inputs
        new, out = cell(state, xw_t, w_hh, b_hh, w_hr)
        if valid_t is not None:  # a packed sequence past its end keeps its state and outputs zeros
            keep = valid_t[:, None]
            new = tuple(jnp.where(keep, n, s) for n, s in zip(new, state))
            out = jnp.where(keep, out, jnp.zeros((), out.dtype))
        return new, out

    return lax.scan(step, carry, (xw, valid), reverse=reverse)


def _dropped(x, p, key):
    keep = jax.random.bernoulli(key, 1.0 - p, x.shape)
    return jnp.where(keep, x * jnp.asarray(1.0 / (1.0 - p), x.dtype), jnp.zeros((), x.dtype))


def sequence(input, params, hx, cx, mode, num_layers, has_biases, bidirectional, batch_first, batch_sizes,
             dropout=0.0, key=None):
    """output, h_n, c_n (an empty array but for LSTM) of a whole multi-layer recurrent layer."""
    directions = 2 if bidirectional else 1
    groups = _unpack(params, mode, num_layers, has_biases, directions)
    if batch_sizes is not None:
        rows, valid_np, flat, steps, batch = _packed_layout(batch_sizes)
        valid = jnp.asarray(valid_np)
        x = jnp.where(valid[..., None], input[jnp.asarray(rows)], jnp.zeros((), input.dtype))
    else:
        valid = None
        x = jnp.swapaxes(input, 0, 1) if batch_first else input
    h_n, c_n = [], []
    for layer in range(num_layers):
        if layer > 0 and dropout > 0:
            x = _dropped(x, dropout, jax.random.fold_in(key, layer))
        outs = []
        for d in range(directions):
            k = layer * directions + d
            carry = (hx[k], cx[k]) if mode == "LSTM" else (hx[k],)
            carry, ys = _direction(x, valid, carry, groups[k], mode, reverse=d == 1)
            h_n.append(carry[0])
            if mode == "LSTM":
                c_n.append(carry[1])
            outs.append(ys)
        x = outs[0] if directions == 1 else jnp.concatenate(outs, axis=-1)
    if batch_sizes is not None:
        output = x.reshape(-1, x.shape[-1])[jnp.asarray(flat)]
    else:
        output = jnp.swapaxes(x, 0, 1) if batch_first else x
    c = jnp.stack(c_n) if mode == "LSTM" else jnp.zeros((0,), input.dtype)
    return output, jnp.stack(h_n), c


@lower(torch.ops.tpu_agent.rnn.default, static_floats=True, meta_check=False)
def rnn(input, params, hx, cx, mode, num_layers, has_biases, bidirectional, batch_first, batch_sizes):
    return sequence(input, params, hx, cx, mode, num_layers, has_biases, bidirectional, batch_first, batch_sizes)


@lower(torch.ops.tpu_agent.rnn_dropout.default, static_floats=True, random=True, meta_check=False)
def rnn_dropout(input, params, hx, cx, mode, num_layers, has_biases, bidirectional, batch_first, batch_sizes,
                dropout, *, key):
    out = sequence(input, params, hx, cx, mode, num_layers, has_biases, bidirectional, batch_first, batch_sizes,
                   dropout, key)
    return (*out, _seed(key))


@lower(torch.ops.tpu_agent.rnn_backward.default, static_floats=True, meta_check=False)
def rnn_backward(grad_output, grad_hy, grad_cy, input, params, hx, cx, seed, mode, num_layers, has_biases,
                 bidirectional, batch_first, batch_sizes, dropout):
    key = _key(seed) if seed is not None else None
    lstm = mode == "LSTM"

    def forward(input, params, hx, cx):
        return sequence(input, params, hx, cx if lstm else None, mode, num_layers, has_biases, bidirectional,
                        batch_first, batch_sizes, dropout if seed is not None else 0.0, key)

    c0 = cx if lstm else jnp.zeros((0,), input.dtype)
    (_, _, c), pullback = jax.vjp(forward, input, list(params), hx, c0)
    g_c = grad_cy if lstm and grad_cy is not None else jnp.zeros(c.shape, c.dtype)
    g_input, g_params, g_hx, g_cx = pullback((grad_output, grad_hy, g_c))
    return g_input, g_params, g_hx, g_cx


# --------------------------------------------------------------------------
# the fused cells (nn.LSTMCell, nn.GRUCell, and the composite path's cells)
# --------------------------------------------------------------------------


def _with_biases(gates, b1, b2):
    if b1 is not None:
        gates = gates + b1
    if b2 is not None:
        gates = gates + b2
    return gates


@lower(aten._thnn_fused_lstm_cell.default)
def thnn_fused_lstm_cell(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    i, f, g, o = jnp.split(_with_biases(input_gates + hidden_gates, input_bias, hidden_bias), 4, axis=-1)
    i, f, g, o = jax.nn.sigmoid(i), jax.nn.sigmoid(f), jnp.tanh(g), jax.nn.sigmoid(o)
    cy = f * cx + i * g
    hy = o * jnp.tanh(cy)
    return hy, cy, jnp.concatenate([i, f, g, o], axis=-1)


@lower(aten._thnn_fused_lstm_cell_backward_impl.default)
def thnn_fused_lstm_cell_backward_impl(grad_hy, grad_cy, cx, cy, workspace, has_bias):
    i, f, g, o = jnp.split(workspace, 4, axis=-1)
    tanh_cy = jnp.tanh(cy)
    grad_hy = jnp.zeros_like(cy) if grad_hy is None else grad_hy
    grad_c = (jnp.zeros_like(cy) if grad_cy is None else grad_cy) + grad_hy * o * (1 - tanh_cy * tanh_cy)
    gates = jnp.concatenate([
        grad_c * g * i * (1 - i),
        grad_c * cx * f * (1 - f),
        grad_c * i * (1 - g * g),
        grad_hy * tanh_cy * o * (1 - o),
    ], axis=-1)
    grad_bias = jnp.sum(gates, axis=0) if has_bias else None
    return gates, grad_c * f, grad_bias


@lower(aten._thnn_fused_gru_cell.default)
def thnn_fused_gru_cell(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    x_r, x_z, x_n = jnp.split(_with_biases(input_gates, input_bias, None), 3, axis=-1)
    h_r, h_z, h_n = jnp.split(_with_biases(hidden_gates, hidden_bias, None), 3, axis=-1)
    r = jax.nn.sigmoid(x_r + h_r)
    z = jax.nn.sigmoid(x_z + h_z)
    n = jnp.tanh(x_n + r * h_n)
    hy = (1 - z) * n + z * hx
    return hy, jnp.concatenate([r, z, n, hx, h_n], axis=-1)


@lower(aten._thnn_fused_gru_cell_backward.default)
def thnn_fused_gru_cell_backward(grad_hy, workspace, has_bias):
    r, z, n, hx, h_n = jnp.split(workspace, 5, axis=-1)
    grad_n = grad_hy * (1 - z) * (1 - n * n)
    grad_z = grad_hy * (hx - n) * z * (1 - z)
    grad_r = grad_n * h_n * r * (1 - r)
    grad_input = jnp.concatenate([grad_r, grad_z, grad_n], axis=-1)
    grad_hidden = jnp.concatenate([grad_r, grad_z, grad_n * r], axis=-1)
    grad_hx = grad_hy * z
    if not has_bias:
        return grad_input, grad_hidden, grad_hx, None, None
    return grad_input, grad_hidden, grad_hx, jnp.sum(grad_input, axis=0), jnp.sum(grad_hidden, axis=0)
