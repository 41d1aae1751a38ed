"""Compiled steps as one XLA program per step (issue #28 point 1): an unmodified loop (forward, backward, gradient
clipping, optimizer step, LR scheduler, zero_grad) launches one program per step in steady state, with the CPU's
losses; a host read mid-step splits the step and says why; new shapes and hyperparameters re-capture."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

from tpu_agent.backend.compiled import auto_compile
from tpu_agent.backend.core import executables
from tpu_agent.backend.compiled.whole_step import WINDOW


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(12, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.drop = torch.nn.Dropout(0.0)
        self.fc2 = torch.nn.Linear(32, 5)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.norm(self.fc1(x)))))


def _launches() -> int:
    return sum(e.calls for e in executables.all())


def _batches(n: int, rows=lambda i: 16):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(rows(i), 12, generator=g), torch.randint(0, 5, (rows(i),), generator=g)) for i in range(n)]


def _train(device: str, batches, compiled: bool = False, read_mid_step: bool = False, decay_at: int | None = None,
           set_to_none: bool = True):
    """The loop as a user writes it; returns the losses and the programs launched per step."""
    torch.manual_seed(0)
    model = Net().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
    if compiled:
        auto_compile.compile_steps(True)
    losses, programs = [], []
    batches = [(x.to(device), y.to(device)) for x, y in batches]  # a copy from the CPU is a program of its own
    try:
        for i, (x, y) in enumerate(batches):
            if decay_at is not None and i == decay_at:
                opt.param_groups[0]["weight_decay"] = 0.5  # a hyperparameter the program holds as a constant
            before = _launches()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            if read_mid_step:
                losses.append(loss.item())
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=set_to_none)
            if not read_mid_step:
                losses.append(loss.item())
            programs.append(_launches() - before)
    finally:
        auto_compile.compile_steps(False)
    return losses, programs


def test_an_unmodified_loop_runs_one_program_per_step_with_the_cpus_losses():
    batches = _batches(10)
    cpu, _ = _train("cpu", batches)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tpu, programs = _train("tpu", batches, compiled=True)
    assert tpu == pytest.approx(cpu, rel=1e-5)
    assert programs[-4:] == [1, 1, 1, 1], programs
    assert not WINDOW.open  # the user's mode is back after the loop


def test_in_fused_mode_as_the_tuner_sets_it_the_step_is_one_program_and_the_mode_stays():
    """The tuner's `compile: compiled` switches compiled steps on in fused mode (DEFER_AND_FUSE)."""
    batches = _batches(8)
    cpu, _ = _train("cpu", batches, set_to_none=False)
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
        tpu, programs = _train("tpu", batches, compiled=True, set_to_none=False)
        assert torch.tpu.get_eager_mode() is torch.tpu.EagerMode.DEFER_AND_FUSE
    assert tpu == pytest.approx(cpu, rel=1e-5)
    assert programs[-3:] == [1, 1, 1], programs


def test_a_host_read_mid_step_splits_the_step_and_says_why():
    batches = _batches(8)
    cpu, _ = _train("cpu", batches, read_mid_step=True)
    with pytest.warns(UserWarning, match=r"ran as 2 programs, not one: .*value read on the host.*test_whole_step"):
        tpu, programs = _train("tpu", batches, compiled=True, read_mid_step=True)
    assert tpu == pytest.approx(cpu, rel=1e-5)
    assert programs[-1] == 2, programs


def test_a_new_batch_shape_and_a_changed_hyperparameter_capture_again_with_the_cpus_losses():
    batches = _batches(14, rows=lambda i: 16 if i < 7 else 8)
    cpu, _ = _train("cpu", batches, decay_at=10)
    tpu, programs = _train("tpu", batches, compiled=True, decay_at=10)
    assert tpu == pytest.approx(cpu, rel=1e-5)
    assert programs[-1] == 1, programs


def test_gradients_zeroed_in_place_keep_the_cpus_losses():
    """zero_grad(set_to_none=False) runs after the step's boundary: its writes are outside the step's program."""
    batches = _batches(8)
    cpu, _ = _train("cpu", batches, set_to_none=False)
    tpu, programs = _train("tpu", batches, compiled=True, set_to_none=False)
    assert tpu == pytest.approx(cpu, rel=1e-5)
    assert programs[-1] <= 2, programs


def test_mark_step_ends_the_step_window_of_a_loop_without_an_optimizer():
    torch.manual_seed(0)
    model = Net().to("tpu")
    x = torch.randn(4, 12).to("tpu")
    auto_compile.compile_steps(True)
    try:
        for i in range(3):
            model(x).sum().backward()
            assert WINDOW.open or i == 0  # the model is found at its first call, compiled from its second
            torch.tpu.mark_step()
            assert not WINDOW.open
        grad = model.fc1.weight.grad.cpu()
    finally:
        auto_compile.compile_steps(False)
    torch.manual_seed(0)
    cpu = Net()
    for _ in range(3):
        cpu(x.cpu()).sum().backward()
    torch.testing.assert_close(grad, cpu.fc1.weight.grad, rtol=1e-5, atol=1e-6)


def _aliases(exe) -> dict[int, int]:
    """The compiled program's donated input -> the output XLA writes into its buffer (HLO input_output_alias)."""
    text = exe.fn.lower(*exe.args).compile().as_text()
    header = text[:text.index("\n")]
    return {int(i): int(o) for o, i in re.findall(r"\{(\d+)\}: \((\d+), \{\}, (?:may|must)-alias\)", header)}


def test_the_step_program_updates_the_optimizer_state_in_place_each_array_into_its_own_buffer():
    """Donation in the step's one program: each donated input shares its buffer with the output that replaces it
    (jax pairs a donated input with the first output of its shape: with the gradients first, a parameter was
    paired with its gradient). On XLA:CPU the parameters, which the forward also reads, are not donated."""
    from tpu_agent.backend.core.lazy import RECORDER

    torch.manual_seed(0)
    model = Net().to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    (x, y), = [(a.to("tpu"), b.to("tpu")) for a, b in _batches(1)]
    auto_compile.compile_steps(True)
    try:
        for step in range(6):
            names = {id(p.jax()): name for name, p in model.named_parameters()}
            names |= {id(t.jax()): f"{name}.{key}" for name, p in model.named_parameters()
                      for key, t in opt.state.get(p, {}).items()}
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    finally:
        auto_compile.compile_steps(False)
    exe, inputs, outputs, _ = RECORDER.last_flush
    donated = [d for (exe_id, d) in RECORDER.donating if exe_id == exe.id]
    assert donated, "the step's program donates nothing"
    donating = RECORDER.donating[(exe.id, max(donated, key=lambda d: RECORDER.donating[(exe.id, d)].calls))]
    aliases = _aliases(donating)
    after = {id(p.jax()): name for name, p in model.named_parameters()}
    after |= {id(t.jax()): f"{name}.{key}" for name, p in model.named_parameters() for key, t in opt.state[p].items()}
    pairs = sorted((names[id(inputs[i])], after.get(id(outputs[o].value), "not a state array"))
                   for i, o in aliases.items())
    state = sorted(f"{name}.{key}" for name, p in model.named_parameters() for key in opt.state[p])
    assert pairs == [(s, s) for s in state]  # every state array, into its own buffer, and no parameter



def test_a_fused_graph_is_found_again_only_for_the_same_input_shapes_dtypes_and_sharing():
    """The flush's key takes each input's shape and dtype from the node that read it, as recorded (not again at the
    flush). A node's program may take any shape (a module's or an optimizer's program does): the same program on
    other shapes or dtypes, or on one array where there were two, is another graph; the same again finds it."""
    import jax.numpy as jnp
    import numpy as np

    from tpu_agent.backend.core import lazy

    add = lazy.Program(executables.next_id(), "test_add", lambda a, b: a + b, {})

    def run(a, b):
        out = lazy.RECORDER.record(add, [a, b])
        lazy.RECORDER.flush("sync", also=[out])
        return np.asarray(out.value)

    x, y = jnp.arange(3.0), jnp.arange(3.0) + 10
    cases = [(x, y), (x, x), (x[:2], y[:2]), (x.astype(jnp.int32), y.astype(jnp.int32)), (x, y)]
    graphs = []
    for a, b in cases:
        np.testing.assert_array_equal(run(a, b), np.asarray(a) + np.asarray(b))
        graphs.append(len(lazy.RECORDER.graphs))
    assert [g - graphs[0] for g in graphs] == [0, 1, 2, 3, 3]  # four graphs; the last case finds the first's
