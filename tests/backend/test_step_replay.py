"""Compiled steps replay a seen step: clipping, AdamW and an LR scheduler that changes lr every step run as the
same program step after step, with the CPU's losses and parameters; a new batch shape compiles again and says
so once; gradient clipping is one node of the step's graph; the collector's objects are frozen while the step
stops compiling and thawed when it compiles again."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch

from tpu_agent.backend.compiled import auto_compile, optimizer_program
from tpu_agent.backend.core import executables
from tpu_agent.backend.compiled.whole_step import WINDOW


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 16)
        self.fc2 = torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def _batches(rows):
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(r, 6, generator=g) * 4, torch.randint(0, 3, (r,), generator=g)) for r in rows]


def _train(device, batches, compiled=False):
    """Returns the losses, the parameters after each step, and the executables made at each step."""
    torch.manual_seed(0)
    model = Net().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.3 * s))  # a new lr every step
    if compiled:
        auto_compile.compile_steps(True)
    losses, params, made = [], [], []
    batches = [(x.to(device), y.to(device)) for x, y in batches]
    try:
        for x, y in batches:
            before = len(executables.all())
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3)  # clips: the gradients are larger
            opt.step()
            sched.step()
            opt.zero_grad()
            losses.append(loss.item())
            params.append([p.detach().cpu().clone() for p in model.parameters()])
            made.append(len(executables.all()) - before)
        frozen = gc.get_freeze_count() if compiled else 0
    finally:
        if compiled:
            auto_compile.compile_steps(False)
    return losses, params, made, frozen


def test_a_replayed_step_with_clipping_adamw_and_a_scheduler_gives_the_cpus_losses_and_parameters():
    batches = _batches([8] * 9)
    cpu_losses, cpu_params, _, _ = _train("cpu", batches)
    clips = optimizer_program.clip_nodes_recorded
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # replaying, with lr changing every step, says nothing
        losses, params, made, frozen = _train("tpu", batches, compiled=True)
    assert losses == pytest.approx(cpu_losses, rel=1e-5)
    for step_cpu, step_tpu in zip(cpu_params, params):
        for c, t in zip(step_cpu, step_tpu):
            torch.testing.assert_close(t, c, rtol=1e-5, atol=1e-6)
    assert made[4:] == [0] * 5, made  # lr is an input of the update: no new program as the scheduler moves it
    assert optimizer_program.clip_nodes_recorded - clips >= 5  # clipping recorded as one node in the window
    assert frozen > 0  # compiling stopped: the collector's objects frozen
    assert gc.get_freeze_count() == 0 and not WINDOW.frozen  # compile_steps(False) thaws them


def test_a_new_batch_shape_compiles_again_once_says_why_once_and_keeps_the_cpus_numbers():
    batches = _batches([8] * 6 + [5] * 5)
    cpu_losses, cpu_params, _, _ = _train("cpu", batches)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses, params, made, _ = _train("tpu", batches, compiled=True)
    again = [str(w.message) for w in caught if "compiles again" in str(w.message)]
    assert len(again) == 1, again
    assert "new input shapes" in again[0] and "[5, 6]" in again[0], again
    assert losses == pytest.approx(cpu_losses, rel=1e-5)
    for c, t in zip(cpu_params[-1], params[-1]):
        torch.testing.assert_close(t, c, rtol=1e-5, atol=1e-6)
    assert made[6] > 0 and made[-2:] == [0, 0], made  # the new shape compiled, then replays


def test_a_changed_hyperparameter_compiles_again_and_names_it():
    torch.manual_seed(0)
    model = Net().to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = (t.to("tpu") for t in _batches([4])[0])
    auto_compile.compile_steps(True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(10):
                if i == 7:
                    opt.param_groups[0]["weight_decay"] = 0.5
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
    finally:
        auto_compile.compile_steps(False)
    again = [w for w in caught if "compiles again" in str(w.message)]
    assert len(again) == 1 and "weight_decay" in str(again[0].message), again
    assert again[0].filename == __file__, again[0].filename  # the user's line (opt.step()), not the device's
