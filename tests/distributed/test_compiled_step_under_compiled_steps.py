"""A torch.compile'd step under compiled steps (the tuner's `compile: compiled` on a script that compiles its step)
runs as the torch.compile'd step does: one replayed program per step, the same losses. Before, the model's and the
optimizer's own programs ran inside the step's capture, which then gave up on replay: 4 programs per step in one
process, 7 at 2 ranks on an FSDP x TP mesh (tests/distributed/programs_per_step.py tp compile). The same held for a
model the script compiles itself, called inside its compiled step."""

from __future__ import annotations

import warnings

import pytest
import torch

from tpu_agent.backend.compiled import auto_compile
from tpu_agent.backend.core import executables


def _train(compile_steps: bool, fused: bool = False, compile_model: bool = False):
    """Eight steps of a torch.compile'd step; the losses and the programs launched per step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                                torch.nn.Linear(32, 5)).to("tpu")
    if compile_model:
        model = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(x, y):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    run = torch.compile(step)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 12, generator=g).to("tpu"), torch.randint(0, 5, (16,), generator=g).to("tpu"))
               for _ in range(8)]
    losses, programs = [], []
    mode = torch.tpu.EagerMode.DEFER_AND_FUSE if fused else torch.tpu.get_eager_mode()
    if compile_steps:
        auto_compile.compile_steps(True)
    try:
        with torch.tpu.set_eager_mode(mode), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for x, y in batches:
                torch.tpu.synchronize()
                before = sum(e.calls for e in executables.all())
                loss = run(x, y)
                torch.tpu.synchronize()
                programs.append(sum(e.calls for e in executables.all()) - before)
                losses.append(loss.item())
    finally:
        auto_compile.compile_steps(False)
    assert not [str(w.message) for w in caught if "cannot be one program" in str(w.message)]
    return losses, programs


@pytest.mark.parametrize("fused", [False, True], ids=["eager", "fused mode, as the tuner sets it"])
def test_a_compiled_step_under_compiled_steps_is_one_replayed_program_with_the_same_losses(fused):
    alone, alone_programs = _train(compile_steps=False, fused=fused)
    both, programs = _train(compile_steps=True, fused=fused)
    assert alone_programs[-4:] == [1, 1, 1, 1], alone_programs
    assert programs[-4:] == [1, 1, 1, 1], programs
    assert both == pytest.approx(alone, rel=1e-6, abs=1e-6)


def test_a_model_the_script_compiled_inside_its_compiled_step_is_part_of_the_steps_program():
    """torch.compile(model) called inside torch.compile(step): its programs inside the step's capture gave up
    replay the same way (4 programs per step)."""
    alone, _ = _train(compile_steps=False)
    both, programs = _train(compile_steps=False, compile_model=True)
    assert programs[-4:] == [1, 1, 1, 1], programs
    assert both == pytest.approx(alone, rel=1e-6, abs=1e-6)
