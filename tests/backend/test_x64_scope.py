"""JAX's 64-bit mode, scoped to the device: int64 (and float64) keep PyTorch's values on tpu, while the process's
own `jax_enable_x64` stays as the user set it, for the user's JAX code in the same process."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tpu_agent.backend.core import jax_setup, programs, transfer
from tpu_agent.backend.core.launch import launch

BIG = [2**40 + 3, -(2**35) + 7, 5, 2**62 - 1, -(2**31) - 1, 2**31]  # none of them fits int32 but 5


def _user_sees_32_bit() -> None:
    """What a user's own JAX code sees with x64 off (JAX's default, this test process's setting)."""
    assert jax.config.jax_enable_x64 is False
    assert jnp.arange(3).dtype == jnp.int32
    assert jnp.asarray(np.arange(3, dtype=np.int64)).dtype == jnp.int32
    assert jax.jit(lambda v: v * 2)(jnp.ones(3, jnp.float32)).dtype == jnp.float32


@pytest.fixture(autouse=True)
def _x64_off_as_jax_defaults():
    if jax.config.jax_enable_x64:
        pytest.skip("this process runs with JAX_ENABLE_X64 set: the default the tests check is not in force")
    yield
    assert jax.config.jax_enable_x64 is False, "a test left jax_enable_x64 changed"


class Tagger(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.fc = torch.nn.Linear(16, 7)

    def forward(self, ids):
        """The logits, and an int64 result beyond int32 (a compiled module's integer output)."""
        return self.fc(torch.tanh(self.emb(ids))), (ids + 2**40).cumsum(-1)


def _data():
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 50, (4, 6), generator=g), torch.randint(0, 7, (24,), generator=g)


def _int64_work(device: str):
    """Embedding with int64 ids, cross_entropy with int64 labels, arange, argmax, indexing, a backward."""
    torch.manual_seed(0)
    model = Tagger().to(device)
    ids, labels = (t.to(device) for t in _data())
    assert ids.dtype == labels.dtype == torch.int64
    logits = model(ids)[0].reshape(-1, 7)
    loss = F.cross_entropy(logits, labels)
    loss.backward()
    positions = torch.arange(ids.shape[1], device=device)
    picked = logits.argmax(-1)
    rows = ids[:, positions[::2]]
    return [loss.detach(), model.emb.weight.grad, positions, picked, rows, labels[picked % 24]]


def test_int64_ops_keep_their_dtype_and_values_and_leave_user_jax_32_bit():
    cpu = _int64_work("cpu")
    tpu = _int64_work("tpu")
    for c, t in zip(cpu, tpu):
        assert t.dtype == c.dtype
        torch.testing.assert_close(t.cpu(), c, rtol=1e-5, atol=1e-6)
    assert tpu[2].dtype == tpu[3].dtype == torch.int64
    _user_sees_32_bit()


@pytest.mark.parametrize("mode", ["eager", "fused"])
def test_int64_values_beyond_int32_round_trip_exactly(mode):
    a = torch.tensor(BIG, dtype=torch.int64)
    b = torch.tensor([3, -2, 2**33, 1, 7, -1], dtype=torch.int64)
    index = torch.tensor([5, 0, 3, 3], dtype=torch.int64)

    def work(x, y, i):
        out = torch.zeros(6, dtype=torch.int64, device=x.device).index_add(0, i[:2], x[i[2:]])
        return [x + y, x * 3, torch.cumsum(x, 0), x[i], x.index_select(0, i), torch.gather(x, 0, i),
                x.clone().index_put_((i[:2],), y[:2]), out, (x // 7), x.max().reshape(1), x.sort().values]

    expected = work(a, b, index)
    mode_of = torch.tpu.EagerMode.DEFER_AND_FUSE if mode == "fused" else torch.tpu.EagerMode.DEFER_NEVER
    with torch.tpu.set_eager_mode(mode_of):
        got = [t.cpu() for t in work(a.to("tpu"), b.to("tpu"), index.to("tpu"))]
    for g, e in zip(got, expected):
        assert g.dtype == torch.int64
        assert torch.equal(g, e), (g, e)
    assert a.to("tpu").to(torch.float64).cpu().tolist() == [float(v) for v in BIG]  # float64 too
    assert a.to("tpu").tolist() == BIG and a.to("tpu")[0].item() == BIG[0]
    _user_sees_32_bit()


def _step_work(compiled: str):
    torch.manual_seed(0)
    model = Tagger().to("tpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ids, labels = (t.to("tpu") for t in _data())

    def step(ids, labels):
        logits, big = model(ids)
        loss = F.cross_entropy(logits.reshape(-1, 7), labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss, big

    run = torch.tpu.compile(step) if compiled.startswith("step") else step
    if compiled == "module":
        model = torch.compile(model)
    if compiled == "compile_steps":  # the unmodified loop's programs, recorded as nodes of one graph a step
        torch.tpu.compile_steps(True)
    try:
        losses, bigs = [], []
        for _ in range(3):
            loss, big = run(ids, labels)
            losses.append(loss.item())
            bigs.append(big.cpu())
    finally:
        torch.tpu.compile_steps(False)
    return losses, bigs


def _cpu_losses():
    torch.manual_seed(0)
    model = Tagger()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ids, labels = _data()
    losses = []
    for _ in range(3):
        logits, big = model(ids)
        loss = F.cross_entropy(logits.reshape(-1, 7), labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, big


@pytest.mark.parametrize("compiled", ["fused", "step", "step-fused", "module", "compile_steps"])
def test_fused_and_compiled_steps_on_int64_ids_match_the_cpu_and_leave_user_jax_32_bit(compiled):
    fused = compiled in ("fused", "step-fused")
    mode = torch.tpu.EagerMode.DEFER_AND_FUSE if fused else torch.tpu.EagerMode.DEFER_NEVER
    with torch.tpu.set_eager_mode(mode):
        losses, bigs = _step_work(compiled)
    cpu_losses, cpu_big = _cpu_losses()
    assert losses == pytest.approx(cpu_losses, rel=1e-5)
    for big in bigs:
        assert big.dtype == torch.int64 and torch.equal(big, cpu_big)
    _user_sees_32_bit()
    torch.tpu.synchronize()
    _user_sees_32_bit()


def test_a_user_who_turned_x64_on_keeps_it():
    jax.config.update("jax_enable_x64", True)
    try:
        x = torch.tensor(BIG).to("tpu")
        assert ((x * 2).cpu() == torch.tensor(BIG) * 2).all()
        assert jax.config.jax_enable_x64 is True
        assert jnp.arange(3).dtype == jnp.int64
    finally:
        jax.config.update("jax_enable_x64", False)
    _user_sees_32_bit()


def test_user_jax_in_a_device_hook_sees_its_own_setting():
    """Code the device calls back (a step listener after the optimizer's step) runs outside the scope."""
    from tpu_agent.backend.core import steps

    seen = []
    remove = steps.add_step_listener(lambda source: seen.append(jnp.arange(2).dtype))
    try:
        _step_work("fused")
    finally:
        remove()
    assert seen and set(seen) == {jnp.dtype(jnp.int32)}


def test_a_cached_program_run_from_outside_an_op_runs_64_bit():
    """launch() is where every program runs: called with the scope off (a compiled module's program, a step's),
    it scopes the call; a jitted function called outside would trace again with int32 and truncate."""
    with jax_setup.device_x64():
        big = jnp.asarray(np.array(BIG, dtype=np.int64))
        exe, _ = programs.new_program("x64_scope_test", "eager", lambda v: v * 2 + 1, [big])
        first = launch(exe, [big])
    again = launch(exe, [big])  # the scope is off here: as a module program's launch is
    assert again.dtype == first.dtype == jnp.int64
    assert np.asarray(again).tolist() == [v * 2 + 1 for v in BIG]
    assert "s64" in exe.hlo_text()  # the profiler's analyses lower it as it runs, outside the scope too
    _user_sees_32_bit()


def test_a_copy_outside_the_scope_fails_loudly_instead_of_truncating():
    """The guard on host copies: JAX outside the scope narrows int64 to int32; the copy raises, naming it."""
    t = torch.tensor(BIG)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # JAX's own warning (an error in this suite) would hide the guard
        with pytest.raises(RuntimeError, match="outside the device's 64-bit scope"):
            transfer.from_cpu(t)
    with jax_setup.device_x64():
        assert np.asarray(transfer.from_cpu(t)).tolist() == BIG


def test_the_suite_turns_jax_narrowing_into_an_error():
    """pyproject's filterwarnings: a JAX call of the device's that escaped the scope fails its test."""
    with pytest.raises(UserWarning, match="Explicitly requested dtype"):
        jnp.zeros(3, jnp.int64)


class TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 2)

    def forward(self, x):
        h = self.a(x)
        return self.b(h), h * 2


def test_a_compiled_float64_module_whose_second_output_is_unused_backpropagates():
    """autograd calls a compiled module's backward directly (not through an op): the zero cotangent of the output
    the loss leaves out is made there, float64 as the output is."""
    grads = {}
    for device in ("cpu", "tpu"):
        torch.manual_seed(0)
        model = TwoHeads().double().to(device)
        x = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).to(device)
        run = torch.compile(model) if device == "tpu" else model
        out, _unused = run(x)
        out.sum().backward()
        assert out.dtype == torch.float64
        grads[device] = model.a.weight.grad.cpu()
    assert grads["tpu"].dtype == torch.float64
    torch.testing.assert_close(grads["tpu"], grads["cpu"], rtol=1e-12, atol=1e-12)
    _user_sees_32_bit()


def test_a_compiled_steps_replay_draws_eagers_masks_under_a_64_bit_seed():
    """A replay reads its RNG inputs outside any op; the key of a seed beyond 32 bits is made as an op makes it
    (made 32-bit, it drew other dropout masks than eager mode)."""
    x = torch.ones(4, 64).to("tpu")

    def step(x):
        return F.dropout(x, 0.5, training=True).sum(-1)

    compiled = torch.tpu.compile(step)
    compiled(x)
    compiled(x)  # captured, then replayed
    for seed in (7, 2**40 + 5):
        torch.tpu.manual_seed(seed)
        eager = step(x).cpu()
        torch.tpu.manual_seed(seed)
        assert torch.equal(compiled(x).cpu(), eager), seed
    _user_sees_32_bit()
