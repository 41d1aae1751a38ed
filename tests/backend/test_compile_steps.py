"""Compiled steps with no change to the script: the model's forward and backward programs, each optimizer's
update as one program, PyTorch's hooks and LR schedulers around them, and the CPU's losses."""

from __future__ import annotations

import warnings

import pytest
import torch

from tpu_agent.backend.compiled import auto_compile
from tpu_agent.backend.core import steps
from tpu_agent.backend.compiled.step_program import CompiledStep


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(12, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.fc2 = torch.nn.Linear(32, 5)

    def forward(self, x):
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 12, generator=g), torch.randint(0, 5, (16,), generator=g)


def _train(device: str, n: int = 10, compiled: bool = False, scheduler: bool = False, set_to_none: bool = True):
    torch.manual_seed(0)
    model = Net().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5) if scheduler else None
    x, y = (t.to(device) for t in _data())
    found = len(auto_compile.STATE.optimizers)
    if compiled:
        auto_compile.compile_steps(True)
    try:
        losses = []
        for _ in range(n):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
            if sched is not None:
                sched.step()
            losses.append(loss.item())
    finally:
        auto_compile.compile_steps(False)
    return losses, model, opt, auto_compile.STATE.optimizers[found:]


@pytest.mark.parametrize("set_to_none", [True, False], ids=["grads-set-to-none", "grads-zeroed"])
def test_an_unmodified_loop_runs_as_programs_with_the_cpus_losses(set_to_none):
    cpu, *_ = _train("cpu", set_to_none=set_to_none)
    tpu, model, opt, programs = _train("tpu", compiled=True, set_to_none=set_to_none)
    assert tpu == pytest.approx(cpu, rel=1e-5)
    assert "forward" in model.__dict__, "the model's forward was not compiled"
    (program,) = programs
    assert program.reason_not_replayed is None
    assert program.replays >= 10 - 3  # the first step runs as written, then two captures agree


def test_optimizer_hooks_and_step_markers_run_on_every_replayed_step():
    seen = {"post": 0, "steps": 0}
    remove = steps.add_step_listener(lambda source: seen.__setitem__("steps", seen["steps"] + 1))
    try:
        torch.manual_seed(0)
        model = Net().to("tpu")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        opt.register_step_post_hook(lambda *a: seen.__setitem__("post", seen["post"] + 1))
        x, y = (t.to("tpu") for t in _data())
        auto_compile.compile_steps(True)
        try:
            for _ in range(8):
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
        finally:
            auto_compile.compile_steps(False)
    finally:
        remove()
    assert opt._tpu_program.replays >= 5
    assert seen == {"post": 8, "steps": 8}


def test_an_lr_scheduler_changes_the_update_as_on_the_cpu_without_a_warning():
    cpu, *_ = _train("cpu", n=12, scheduler=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "optimizer.step() has been overridden..." would fail here
        tpu, _, opt, (program,) = _train("tpu", n=12, compiled=True, scheduler=True)
    assert tpu == pytest.approx(cpu, rel=1e-5)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5 ** 3)


def test_the_compiled_model_runs_inference_under_no_grad_like_the_cpu():
    torch.manual_seed(0)
    model = Net()
    x, _ = _data()
    expected = model(x).detach()
    model.to("tpu")
    auto_compile.compile_module(model)
    with torch.no_grad():
        outs = [model(x.to("tpu")).cpu() for _ in range(3)]
    for out in outs:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_a_second_backward_through_the_compiled_model_says_why_it_fails():
    torch.manual_seed(0)
    model = Net().to("tpu")
    auto_compile.compile_module(model)
    x, y = (t.to("tpu") for t in _data())
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second time"):
        loss.backward()


def test_a_compiled_step_that_returns_nothing_updates_once_per_call():
    """A replayed step returning None once looked like a failed replay and ran the step a second time."""
    w = torch.zeros(4).to("tpu")
    g = torch.ones(4).to("tpu")

    def step():
        w.add_(g)

    compiled = CompiledStep(step)
    for _ in range(6):
        compiled()
    assert compiled.replays >= 3
    assert w.cpu().tolist() == [6.0] * 4


def test_replays_update_parameters_in_place_unless_another_tensor_shares_their_array(monkeypatch):
    """Donation: a replayed update may reuse its parameters' buffers, but not one that a tensor made with
    `copy_` (an EMA of the weights, a snapshot) still holds: that tensor keeps its values."""
    from tpu_agent.backend.core import lazy

    monkeypatch.setattr(lazy, "DONATE_READ_INPUTS", True)  # the parameters too, as on an accelerator
    torch.manual_seed(0)
    model = Net().to("tpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = (t.to("tpu") for t in _data())
    auto_compile.compile_steps(True)
    try:
        for _ in range(6):
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        # The update is a node of the step's one program (whole_step.py): that graph donates the parameters.
        from tpu_agent.backend.core.lazy import RECORDER

        assert sum(exe.calls for exe in RECORDER.donating.values()) >= 2
        snapshot = torch.empty_like(model.fc1.weight)
        snapshot.copy_(model.fc1.weight.detach())  # shares the parameter's array
        expected = snapshot.cpu()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    finally:
        auto_compile.compile_steps(False)
    torch.testing.assert_close(snapshot.cpu(), expected, rtol=0, atol=0)
    assert not torch.equal(model.fc1.weight.detach().cpu(), expected)


def test_a_parameter_replaced_after_compiling_is_the_one_the_program_reads():
    torch.manual_seed(0)
    model = Net().to("tpu")
    auto_compile.compile_module(model)
    x, _ = _data()
    for _ in range(4):
        model(x.to("tpu"))
    model.fc2.weight = torch.nn.Parameter(torch.zeros(5, 32).to("tpu"))
    out = model(x.to("tpu")).cpu()
    torch.testing.assert_close(out, model.fc2.bias.detach().cpu().expand(16, 5))


@pytest.mark.parametrize("mode", ["steps", "compiled step"])
def test_dropout_draws_the_same_masks_as_eager_mode(mode):
    """Programs replay the eager stream of random draws: a GPT-2 with dropout on trains to the same losses
    as op-by-op execution (a replay once drew an extra counter for the base key, shifting every mask)."""
    transformers = pytest.importorskip("transformers")

    def run(how):
        torch.manual_seed(0)
        cfg = transformers.GPT2Config(vocab_size=256, n_embd=32, n_layer=1, n_head=2, n_positions=16)
        model = transformers.GPT2LMHeadModel(cfg).to("tpu")
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1)).to("tpu")

        def step():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()

        if how == "compiled step":
            step = torch.compile(step)
        auto_compile.compile_steps(how == "steps")
        try:
            torch.tpu.manual_seed(0)
            return [step().item() for _ in range(7)]
        finally:
            auto_compile.compile_steps(False)

    eager = run("eager")
    assert run(mode) == pytest.approx(eager, rel=1e-5)
