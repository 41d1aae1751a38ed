"""A hand-written MoE block (examples/mixtral_moe.py's, Mixtral's code): seen in the profile, proposed as capacity
padding with its class, and run with fixed shapes that keep the loop's math when no token is dropped."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from support.paths import EXAMPLES
from support.profiles import profile
from tpu_agent.backend.core.state import STATS
from tpu_agent.plan.actions import ExpertCapacity, Plan
from tpu_agent.plan.capacity import ROUTINGS, capacity_of, dispatch, use_expert_capacity
from tpu_agent.plan.runtime import Applied
from tpu_agent.profilers.modules import ModuleWatch, moe_parts
from tpu_agent.propose.conditions import METRICS
from tpu_agent.propose.offline import propose_offline
from tpu_agent.propose.scope import candidates_in_scope


def _example():
    spec = importlib.util.spec_from_file_location("mixtral_moe_example", EXAMPLES / "mixtral_moe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EXAMPLE = _example()


def _block(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return EXAMPLE.SparseMoeBlock()


def _tokens_per_expert(block, x) -> torch.Tensor:
    _, chosen = torch.topk(block.gate(x.reshape(-1, x.shape[-1])), block.top_k, dim=-1)
    return torch.bincount(chosen.reshape(-1), minlength=block.num_experts)


def test_every_token_fits_gives_the_loops_output_and_gradients():
    block = _block()
    x = torch.randn(4, 16, EXAMPLE.D_MODEL, requires_grad=True)
    out, logits = block(x)
    grads = torch.autograd.grad(out.square().sum(), [x, *block.parameters()])
    router, experts, top_k = moe_parts(block)
    flat = x.reshape(-1, x.shape[-1])
    padded, padded_logits = dispatch(flat, router, experts, top_k, ROUTINGS["softmax, top-k, renormalized"], None)
    padded = padded.reshape(x.shape)
    padded_grads = torch.autograd.grad(padded.square().sum(), [x, *block.parameters()])
    assert torch.equal(padded_logits, logits)
    assert torch.allclose(padded, out, rtol=1e-6, atol=1e-7)
    for a, b in zip(grads, padded_grads):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    # the other routings are other math: the check at first call tells them apart
    other, _ = dispatch(flat, router, experts, top_k, ROUTINGS["softmax, top-k"], None)
    assert not torch.allclose(other.reshape(x.shape), out, rtol=1e-4, atol=1e-5)


def test_a_capacity_factor_drops_the_tokens_over_an_experts_capacity():
    block = _block()
    x = torch.randn(4, 16, EXAMPLE.D_MODEL)
    counts = _tokens_per_expert(block, x)
    tokens = x.shape[0] * x.shape[1]
    capacity = capacity_of(tokens, block.num_experts, block.top_k, 1.0)
    assert capacity == tokens * block.top_k // block.num_experts
    assert counts.max() > capacity  # this routing overflows an expert at factor 1
    router, experts, top_k = moe_parts(block)
    with torch.no_grad():
        full, _ = block(x)
        dropped, _ = dispatch(x.reshape(-1, x.shape[-1]), router, experts, top_k,
                              ROUTINGS["softmax, top-k, renormalized"], 1.0)
    changed = (dropped.reshape(x.shape) - full).abs().amax(-1).reshape(-1) > 1e-6
    assert 0 < int(changed.sum()) <= int((counts - capacity).clamp(min=0).sum())  # only tokens that overflowed
    assert capacity_of(tokens, 8, 2, 8.0) == tokens  # never more slots than tokens


def test_the_block_is_switched_at_its_first_call_and_one_it_cannot_reproduce_keeps_its_loop():
    block = _block()
    x = torch.randn(2, 8, EXAMPLE.D_MODEL)
    with torch.no_grad():
        expected = block(x)
    applied = Applied()
    remove = use_expert_capacity(None, applied)
    try:
        model = nn.Sequential(block)
        with torch.no_grad():
            got = model(x)
    finally:
        remove()
    assert "forward" in block.__dict__
    assert applied.notes == ["SparseMoeBlock: experts capacity-padded, every token (none dropped) "
                             "(routing: softmax, top-k, renormalized)"]
    assert isinstance(got, tuple) and torch.allclose(got[0], expected[0], rtol=1e-6, atol=1e-7)

    class SigmoidRouted(EXAMPLE.SparseMoeBlock):  # a routing none of the known ones reproduces
        def forward(self, hidden_states):
            flat = hidden_states.reshape(-1, hidden_states.shape[-1])
            weights = torch.sigmoid(self.gate(flat))
            out = sum(weights[:, i, None] * e(flat) for i, e in enumerate(self.experts))
            return out.reshape(hidden_states.shape)

    torch.manual_seed(0)
    odd = SigmoidRouted()
    applied = Applied()
    remove = use_expert_capacity(None, applied)
    try:
        with torch.no_grad():
            first, second = odd(x), odd(x)
    finally:
        remove()
    assert "forward" not in odd.__dict__  # its own forward again
    assert applied.notes == ["SigmoidRouted kept its expert loop: capacity padding did not reproduce its output"]
    assert torch.equal(first, second)


def test_the_profile_records_the_block_and_the_playbooks_propose_capacity_with_its_class():
    torch.manual_seed(0)
    model = EXAMPLE.MoeLM()
    assert moe_parts(model) is None and moe_parts(model.blocks[0].attn) is None
    watch = ModuleWatch()
    watch.record(model)
    (experts,) = watch.report().experts
    assert (experts.kind, experts.implementation, experts.experts, experts.count) == ("SparseMoeBlock", "loop", 8, 2)
    recorded = profile("transformer").model_copy(update={"modules": watch.report()})
    assert METRICS["moe_loops"][1](recorded) == 2 and METRICS["moe_loops"][1](profile("transformer")) == 0
    assert METRICS["experts_loops"][1](recorded) == 0  # not Hugging Face's experts interface

    found = {c.playbook: c for c in propose_offline(recorded).candidates}
    exact, drop = found["moe-capacity"], found["moe-capacity-drop"]
    assert [a.effect for option in exact.options() for a in option] == ["exact"]
    assert {a.effect for option in drop.options() for a in option} == {"training"}
    kept, left_out = candidates_in_scope(propose_offline(recorded), allow=())
    assert "moe-capacity" in {c.playbook for c in kept.candidates}
    assert "moe-capacity-drop" not in {c.playbook for c in kept.candidates}
    assert any("moe-capacity-drop" in line or "capacity factor" in line for line in left_out), left_out
    assert not {"moe-capacity", "moe-capacity-drop"} & {c.playbook for c in propose_offline(profile("transformer")).candidates}


def test_the_action_says_its_class_and_how_to_get_it_without_the_tool():
    exact, drop = ExpertCapacity(), ExpertCapacity(capacity_factor=1.25)
    assert Plan(actions=[exact]).effects() == ["exact"] and Plan(actions=[exact]).preserves_numerics
    assert Plan(actions=[drop]).effects() == ["training"] and not drop.preserves_numerics
    assert ExpertCapacity(capacity_factor=2.0, effect="exact").effect == "training"  # decided, never given
    assert exact.describe() == "MoE experts capacity-padded (every token)"
    assert "give each expert ceil(1.25 * tokens * top_k / experts) slots, place" in drop.instruction()
    assert "give each expert as many slots as the batch has tokens (none is dropped), place" in exact.instruction()
    from tpu_agent.report.effects import effect_line

    assert effect_line(drop, []).startswith("training (different training (batch, sequence length, or the tokens an "
                                            "expert takes)): MoE experts capacity-padded (capacity factor 1.25); a "
                                            "token routed to an expert past its slots loses that expert's output")
    assert "no token is dropped" in effect_line(exact, [])
    assert Plan.model_validate_json(Plan(actions=[drop]).model_dump_json()) == Plan(actions=[drop])


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(64, EXAMPLE.D_MODEL)
        self.moe = EXAMPLE.SparseMoeBlock()
        self.head = nn.Linear(EXAMPLE.D_MODEL, 64)

    def forward(self, ids):
        return self.head(self.moe(self.tok(ids))[0])


def _train(factor_or_loop, steps: int = 5):
    """Eager tpu steps of a one-block MoE LM: (losses, programs compiled per step, notes)."""
    torch.manual_seed(0)
    model = _Tiny().to("tpu")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    applied = Applied()
    remove = use_expert_capacity(factor_or_loop, applied) if factor_or_loop != "loop" else None
    losses, compiles = [], []
    try:
        for step in range(steps):
            ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(step)).to("tpu")
            before = STATS.compiles
            loss = F.cross_entropy(model(ids).reshape(-1, 64), ids.reshape(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            compiles.append(STATS.compiles - before)
    finally:
        if remove is not None:
            remove()
    return losses, compiles, applied.notes


def test_on_tpu_capacity_padding_stops_the_per_step_compiles_and_keeps_the_losses():
    loop_losses, loop_compiles, _ = _train("loop")
    losses, compiles, notes = _train(None)
    assert any("capacity-padded" in n for n in notes), notes
    assert sum(loop_compiles[2:]) > 0, loop_compiles  # new token counts per expert, new programs
    assert compiles[2:] == [0] * 3, compiles
    assert losses == pytest.approx(loop_losses, rel=1e-5)
