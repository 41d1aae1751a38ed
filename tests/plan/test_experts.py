"""A Hugging Face MoE whose experts loop over the experts hit: seen in the profile, proposed, and switched at run
time to a static-shape implementation that stops the per-step compiles and keeps the losses."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from support import hf_models  # noqa: E402
from support.profiles import profile  # noqa: E402
from tpu_agent.backend.core.state import STATS  # noqa: E402
from tpu_agent.plan.actions import ExpertsImplementation, Plan  # noqa: E402
from tpu_agent.plan.experts import use_experts_implementation  # noqa: E402
from tpu_agent.plan.runtime import Applied  # noqa: E402
from tpu_agent.profilers.modules import ModuleWatch  # noqa: E402
from tpu_agent.propose.conditions import METRICS  # noqa: E402
from tpu_agent.propose.offline import propose_offline  # noqa: E402

# Two steps of warm-up (the first step compiles the step, the second AdamW's state update), then steps whose
# compiles tell the loop (new token counts, new programs: one step shows it, each compiling anew) from static
# shapes (none: two steps show it).
STEPS, LOOP_STEPS = 4, 3


def _train(switch_to: str | None, steps: int = STEPS) -> tuple[list[float], list[int], object, Applied]:
    """Fused steps of the experts-loop model: (losses, programs compiled per step, the model, what was applied)."""
    model, optimizer, inputs = hf_models.build("qwen3_moe_loop", "eager", "tpu")
    applied = Applied()
    remove = use_experts_implementation(switch_to, applied) if switch_to else None
    losses, compiles = [], []
    try:
        with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
            for _ in range(steps):
                before = STATS.compiles
                loss = model(**inputs).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                losses.append(loss.item())
                compiles.append(STATS.compiles - before)
    finally:
        if remove is not None:
            remove()  # gone after the first step already; said again in case a step failed before it
    return losses, compiles, model, applied


def test_the_profile_records_the_experts_loop_and_the_playbook_proposes_static_shapes():
    model, _, _ = hf_models.build("qwen3_moe_loop", "eager", "tpu")
    watch = ModuleWatch()
    watch.record(model)
    built = watch.report()
    (experts,) = built.experts
    assert (experts.kind, experts.implementation, experts.experts, experts.count) == ("Qwen3MoeExperts", "eager", 4, 2)
    assert experts.paths == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]

    recorded = profile("transformer").model_copy(update={"modules": built})
    assert METRICS["experts_loops"][1](recorded) == 2
    assert METRICS["experts_loops"][1](profile("transformer")) == 0  # no MoE: nothing proposed
    ranked = propose_offline(recorded).candidates
    (moe,) = [c for c in ranked if c.playbook == "moe-experts"]
    assert {a.kind for a in moe.actions} == {"experts_implementation"}
    assert not [c for c in propose_offline(profile("transformer")).candidates if c.playbook == "moe-experts"]


def test_static_shape_experts_stop_the_per_step_compiles_and_keep_the_losses():
    loop_losses, loop_compiles, _, _ = _train(None, LOOP_STEPS)
    losses, compiles, model, applied = _train("grouped_mm")
    assert model.config._experts_implementation == "grouped_mm"
    assert any("MoE experts as grouped_mm" in note for note in applied.notes), applied.notes
    assert sum(loop_compiles[2:]) > 0, loop_compiles  # the loop: new token counts, new programs, every step
    assert compiles[2:] == [0] * (STEPS - 2), compiles  # static shapes: nothing compiles after warm-up
    for a, b in zip(loop_losses, losses):  # the same math, summed in another order
        assert b == pytest.approx(a, rel=1e-4)
    assert losses[-1] < losses[0]


def test_the_action_says_its_class_and_how_to_get_it_without_the_tool():
    action = ExpertsImplementation(implementation="batched_mm")
    plan = Plan(actions=[action])
    assert plan.effects() == ["numerics"] and not plan.preserves_numerics
    assert action.describe() == "MoE experts as batched_mm (static shapes, no expert loop)"
    assert 'set_experts_implementation("batched_mm")' in action.instruction()
    assert Plan.model_validate_json(plan.model_dump_json()) == plan
