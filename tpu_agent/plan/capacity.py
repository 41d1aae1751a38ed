"""Capacity padding for a hand-written MoE block (Mixtral-style: a router, a list of experts, a loop over the
experts that picks each one's tokens with `torch.where`): the `expert_capacity` action at run time.

The loop gives every expert a token count that the data decides, so on XLA each count is a new program (and
`torch.where` reads the routing on the host first). With capacity padding each expert takes a fixed number of
slots: the tokens routed to it are placed in its slots in token order, the empty slots hold zeros, each
expert runs on its full slots, and each token gathers its experts' outputs back, weighted by its routing
weights. Every shape is fixed by the batch's token count alone.

`capacity_factor` None gives every expert room for every token (capacity = tokens): no token is ever dropped
and the empty slots never reach a token, so the math is the loop's (exact; it computes experts / top_k times
the loop's expert rows). A factor gives capacity = ceil(factor * tokens * top_k / experts): the tokens over
an expert's capacity lose that expert's contribution, a change of training.

The script's block is not rewritten from its source. At its first call the padded computation is checked
against the block's own forward on the same input (capacity for every token, no gradients): the routing is
the first of softmax-top-k-renormalized, softmax-top-k and top-k-softmax that reproduces the block's output.
A block that none reproduces keeps its loop, said in the trial's notes.
"""

from __future__ import annotations

import math
import types
from typing import Callable

import torch
import torch.nn.functional as F

from tpu_agent.plan.model_hook import until_first_model
from tpu_agent.profilers.modules import moe_parts


def _softmax_topk_norm(logits: torch.Tensor, k: int):
    weights, chosen = torch.topk(F.softmax(logits, dim=1, dtype=torch.float), k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), chosen


def _softmax_topk(logits: torch.Tensor, k: int):
    return torch.topk(F.softmax(logits, dim=1, dtype=torch.float), k, dim=-1)


def _topk_softmax(logits: torch.Tensor, k: int):
    top, chosen = torch.topk(logits, k, dim=-1)
    return F.softmax(top, dim=-1, dtype=torch.float), chosen


ROUTINGS: dict[str, Callable] = {"softmax, top-k, renormalized": _softmax_topk_norm,
                                 "softmax, top-k": _softmax_topk, "top-k, softmax": _topk_softmax}


def capacity_of(tokens: int, experts: int, top_k: int, factor: float | None) -> int:
    """Slots per expert: every token (None), else ceil(factor * tokens * top_k / experts), at most every token."""
    if factor is None:
        return tokens
    return max(1, min(tokens, math.ceil(factor * tokens * top_k / experts)))


def dispatch(x: torch.Tensor, router, experts, top_k: int, routing: Callable, factor: float | None):
    """The block's output (tokens, hidden) and its router logits, every expert run on `capacity` slots."""
    tokens, hidden = x.shape
    count = len(experts)
    logits = router(x)
    weights, chosen = routing(logits, top_k)
    weights = weights.to(x.dtype)
    capacity = capacity_of(tokens, count, top_k, factor)
    expert = chosen.reshape(-1)  # token-major: token t's k-th choice at t * top_k + k
    onehot = (expert[:, None] == torch.arange(count, device=x.device)).long()
    position = ((onehot.cumsum(0) - 1) * onehot).sum(-1)  # the assignment's place in its expert's queue
    kept = position < capacity
    empty = count * capacity  # one slot past the experts' slots: where dropped assignments point
    slot = torch.where(kept, expert * capacity + position, torch.full_like(position, empty))
    token = torch.arange(tokens, device=x.device)[:, None].expand(tokens, top_k).reshape(-1)
    slots = x.new_zeros(empty + 1, hidden).index_copy(0, slot, x[token])
    out = torch.cat([e(slots[i * capacity:(i + 1) * capacity]) for i, e in enumerate(experts)]
                    + [x.new_zeros(1, hidden)])
    gathered = out[slot] * (weights.reshape(-1) * kept.to(x.dtype))[:, None]
    return x.new_zeros(tokens, hidden).index_add(0, token, gathered.to(x.dtype)), logits


def _shape_like(original, out: torch.Tensor, logits: torch.Tensor, shape) -> object | None:
    """The padded result in the block's own return structure: its output, or (output, router logits)."""
    y = out.reshape(shape)
    if isinstance(original, torch.Tensor):
        return y if original.shape == y.shape else None
    if isinstance(original, tuple) and len(original) == 2 and all(isinstance(o, torch.Tensor) for o in original):
        if original[0].shape == y.shape and original[1].shape == logits.shape:
            return (y, logits)
    return None


def _agrees(original, mine) -> bool:
    if mine is None:
        return False
    pairs = [(original, mine)] if isinstance(original, torch.Tensor) else list(zip(original, mine))
    return all(a.dtype == b.dtype and torch.allclose(a.float().cpu(), b.float().cpu(), rtol=1e-4, atol=1e-5)
               for a, b in pairs)


def pad_capacity(module, factor: float | None, notes: list[str]) -> bool:
    """Give `module` (a hand-written MoE block) a capacity-padded forward, checked at its first call against its
    own; False when it is not such a block."""
    parts = moe_parts(module)
    if parts is None:
        return False
    router, experts, top_k = parts
    original = module.forward
    own = module.__dict__.get("forward")  # a forward set on the instance itself, put back if the check fails
    name = type(module).__name__
    state: dict = {}

    def forward(self, hidden_states, *args, **kwargs):
        if args or kwargs or not isinstance(hidden_states, torch.Tensor):
            return original(hidden_states, *args, **kwargs)
        shape = hidden_states.shape
        flat = hidden_states.reshape(-1, shape[-1])
        if "routing" not in state:
            state["routing"] = _choose_routing(original, hidden_states, flat, router, experts, top_k, shape)
            if state["routing"] is None:
                if own is None:
                    del self.forward
                else:
                    self.forward = own
                notes.append(f"{name} kept its expert loop: capacity padding did not reproduce its output")
                return original(hidden_states)
            how = "every token (none dropped)" if factor is None else f"capacity factor {factor:g}"
            notes.append(f"{name}: experts capacity-padded, {how} (routing: {state['routing']})")
        out, logits = dispatch(flat, router, experts, top_k, ROUTINGS[state["routing"]], factor)
        return state["structure"](out, logits, shape)

    def _choose_routing(original_fn, x, flat, router_, experts_, k, shape):
        with torch.no_grad():
            reference = original_fn(x)
            for label, routing in ROUTINGS.items():
                out, logits = dispatch(flat, router_, experts_, k, routing, None)
                mine = _shape_like(reference, out, logits, shape)
                if _agrees(reference, mine):
                    state["structure"] = lambda o, lg, s, ref=reference: _shape_like(ref, o, lg, s)
                    return label
        return None

    module.forward = types.MethodType(forward, module)
    return True


def use_expert_capacity(factor: float | None, applied) -> Callable[[], None]:
    """Capacity-pad every hand-written MoE block of the models the script calls, until the step boundary after
    the first model; returns a function that stops looking early."""
    seen: set[int] = set()

    def find(module) -> bool:
        if id(module) in seen:
            return False
        blocks = 0
        for sub in module.modules():
            if id(sub) not in seen:
                seen.add(id(sub))
                blocks += pad_capacity(sub, factor, applied.notes)
        return bool(blocks)

    return until_first_model(find)
