"""Operand padding (the `PadOps` plan action): matmuls and convolutions run on aligned shapes.

With a multiple set, the matmul lowerings zero-pad M, K and N up to it and
slice the result back; convolutions pad their input and output channels the
same way. Zeros added along a contracted dim contribute nothing to the sums
and padded rows, columns and channels are cut away, so results match the
unpadded op up to summation order (gradients too: they flow back through the
same pad and slice). Whether it pays is for measurement to decide.

Padding can be targeted: with `sizes`, only dims of those sizes are padded
(a GPT-2 LM head's vocabulary of 50257, say), the rest run as they are, so
the copies padding costs are paid only where the tiles are badly filled.
`TPU_AGENT_PAD_OPS=MULTIPLE` or `MULTIPLE:SIZE,SIZE` sets it for a process.
"""

from __future__ import annotations

import jax.numpy as jnp

from tpu_agent import envvars

from .state import STATE


def parse(text: str) -> tuple[int, frozenset[int]]:
    """`"256"` or `"256:50257,1000"` -> (256, {50257, 1000}); `""` -> off."""
    text = (text or "").strip()
    if not text:
        return 0, frozenset()
    multiple, _, sizes = text.partition(":")
    try:
        return int(multiple), frozenset(int(s) for s in sizes.split(",") if s.strip())
    except ValueError:
        raise ValueError(f"TPU_AGENT_PAD_OPS={text!r}: expected MULTIPLE or MULTIPLE:SIZE,SIZE (integers)") from None


STATE.set_padding(*parse(envvars.PAD_OPS.get() or ""))


def multiple() -> int:
    """The current multiple (0: off)."""
    return STATE.pad_multiple


def key() -> tuple[int, frozenset[int]]:
    """What the padding does (multiple and target sizes): part of every op's compile-cache key."""
    return STATE.pad_multiple, STATE.pad_sizes


def set_multiple(value: int, sizes=()) -> None:
    """Pad to multiples of `value` (0: off); only dims of `sizes` when given."""
    STATE.set_padding(value, sizes)


def _up(n: int, m: int) -> int:
    return -(-n // m) * m


def _target(n: int) -> int:
    """The size dim `n` is padded to (itself when padding is off or `n` is not targeted)."""
    multiple, sizes = STATE.pad_multiple, STATE.pad_sizes
    if not multiple or (sizes and n not in sizes):
        return n
    return _up(n, multiple)


def _pad_axis(x, axis: int, size: int):
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def matmul(a, b, preferred_element_type=None):
    """`a @ b` for a (..., M, K) and b (..., K, N), computed on padded shapes when enabled
    (`preferred_element_type`: the result's dtype, e.g. float32 for bfloat16 operands, as jnp.matmul)."""
    if not STATE.pad_multiple or a.ndim < 2 or b.ndim < 2:
        return jnp.matmul(a, b, preferred_element_type=preferred_element_type)
    rows, inner, cols = a.shape[-2], a.shape[-1], b.shape[-1]
    pr, pk, pc = _target(rows), _target(inner), _target(cols)
    if (pr, pk, pc) == (rows, inner, cols):
        return jnp.matmul(a, b, preferred_element_type=preferred_element_type)
    a = _pad_axis(_pad_axis(a, a.ndim - 2, pr), a.ndim - 1, pk)
    b = _pad_axis(_pad_axis(b, b.ndim - 2, pk), b.ndim - 1, pc)
    out = jnp.matmul(a, b, preferred_element_type=preferred_element_type)
    return out if (pr, pc) == (rows, cols) else out[..., :rows, :cols]


def conv(input, weight, run):
    """`run(input, weight)` (an ungrouped NC... x OI... convolution) on channel counts padded to the multiple."""
    c_out, c_in = weight.shape[0], weight.shape[1]
    po, pi = _target(c_out), _target(c_in)
    if (po, pi) == (c_out, c_in):
        return run(input, weight)
    out = run(_pad_axis(input, 1, pi), _pad_axis(_pad_axis(weight, 0, po), 1, pi))
    return out if po == c_out else out[:, :c_out]
