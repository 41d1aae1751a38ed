"""PyTorch semantics on the tpu device, checked against the CPU."""

from __future__ import annotations

import pytest
import torch

from tpu_agent.backend.core.state import STATS


def both(fn):
    """Run `fn(device)` on cpu and tpu; return both results on the CPU."""
    cpu = fn("cpu")
    tpu = fn("tpu")
    convert = lambda v: v.cpu() if isinstance(v, torch.Tensor) else v  # noqa: E731
    if isinstance(cpu, (list, tuple)):
        return list(cpu), [convert(v) for v in tpu]
    return cpu, convert(tpu)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool])
def test_dtypes_round_trip_and_promote(dtype):
    def fn(device):
        x = torch.tensor([[1, 0, 3], [2, 5, 1]]).to(dtype).to(device)
        return [x, x + x, x * 2, x.sum(), (x > 0), x.to(torch.float32) / 2, torch.cat([x, x])]

    cpu, tpu = both(fn)
    for a, b in zip(cpu, tpu):
        assert a.dtype == b.dtype
        torch.testing.assert_close(b, a)


def test_float64_is_kept():
    x = torch.tensor([1.0, 2.0], dtype=torch.float64).to("tpu")
    assert (x * 3).dtype == torch.float64 and (x * 3).cpu().tolist() == [3.0, 6.0]


def test_slice_assignment_updates_the_base():
    cpu, tpu = both(lambda d: _assign(torch.arange(12.0).reshape(3, 4).to(d)))
    torch.testing.assert_close(tpu, cpu)


def _assign(x):
    x[:, 1:] = 0
    x[0] = 7
    x[2, 3] = -1
    return x


def test_in_place_ops_through_views_update_the_base():
    def fn(device):
        base = torch.zeros(4, 5, device=device)
        view = base[1:3, 1:4]
        view.add_(1)
        view.t()[0].mul_(5)
        base.view(-1)[::7].fill_(3)
        row = base.select(0, 3)
        row.copy_(torch.arange(5.0).to(device))
        base.unsqueeze(0).transpose(1, 2)[0, 4].sub_(2)
        return base, view

    cpu, tpu = both(fn)
    for a, b in zip(cpu, tpu):
        torch.testing.assert_close(b, a)


def test_views_see_later_writes_to_the_base():
    def fn(device):
        base = torch.zeros(3, 3, device=device)
        diag = base.diagonal()
        col = base[:, 1]
        base += 2
        base[1, 1] = 9
        return diag + 0, col + 0

    cpu, tpu = both(fn)
    for a, b in zip(cpu, tpu):
        torch.testing.assert_close(b, a)


def test_detach_shares_storage():
    x = torch.ones(3, device="tpu")
    x.detach().zero_()
    assert x.cpu().tolist() == [0.0, 0.0, 0.0]


def test_no_grad():
    w = torch.ones(2, device="tpu", requires_grad=True)
    with torch.no_grad():
        y = w * 2
    assert not y.requires_grad
    z = (w * 2).sum()
    z.backward()
    assert w.grad.cpu().tolist() == [2.0, 2.0]


@pytest.mark.parametrize("optimizer", ["SGD", "Adam", "AdamW"])
@pytest.mark.parametrize("foreach", [True, False])
def test_optimizers_match_cpu(optimizer, foreach):
    def train(device):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).to(device)
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(8, 16, generator=gen).to(device)
        y = torch.randint(0, 4, (8,), generator=gen).to(device)
        kwargs = {"lr": 0.05, "momentum": 0.9} if optimizer == "SGD" else {"lr": 1e-2}
        opt = getattr(torch.optim, optimizer)(model.parameters(), foreach=foreach, **kwargs)
        losses = []
        for _ in range(6):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, foreach=foreach)
            opt.step()
            losses.append(loss.item())
        return losses

    cpu, tpu = train("cpu"), train("tpu")
    assert tpu == pytest.approx(cpu, rel=1e-5)


def test_optimizer_uses_one_foreach_program_by_default():
    model = torch.nn.Linear(4, 4).to("tpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(2, 4, device="tpu")).sum().backward()
    seen = []
    from tpu_agent.backend.core import tensor

    original = tensor._dispatch

    def spy(func, args, kwargs):
        seen.append(str(func))
        return original(func, args, kwargs)

    tensor._dispatch = spy
    try:
        opt.step()
    finally:
        tensor._dispatch = original
    assert "aten._foreach_add_.List" in seen and "aten.add_.Tensor" not in seen


def test_device_mismatch_names_the_op():
    with pytest.raises(RuntimeError, match=r"aten\.add\.Tensor: expected all tensors to be on the tpu device.*cpu"):
        torch.ones(3, device="tpu") + torch.ones(3)


def test_cpu_scalar_tensors_and_cpu_indices_are_accepted_as_on_cuda():
    x = torch.arange(5.0, device="tpu")
    assert (x * torch.tensor(2.0)).cpu().tolist() == [0.0, 2.0, 4.0, 6.0, 8.0]
    assert x[[0, 3]].cpu().tolist() == [0.0, 3.0]


def test_unsupported_dtype_names_the_op():
    with pytest.raises(TypeError, match=r"aten\.\w+.*float8_e4m3fn is not supported on the tpu device"):
        torch.zeros(3, dtype=torch.float8_e4m3fn, device="tpu")


def test_bad_shapes_give_pytorchs_error():
    with pytest.raises(RuntimeError, match=r"aten\.mm\.default"):
        torch.mm(torch.ones(2, 3, device="tpu"), torch.ones(4, 5, device="tpu"))


# An op with a CPU kernel and nothing else: never lowered, never decomposed. (Without device_types its one
# kernel would be for every device, CompositeExplicitAutograd, and runs on tpu as on CUDA: test below.)
@torch.library.custom_op("tpu_agent_test::cube", mutates_args=(), device_types="cpu")
def cube(x: torch.Tensor) -> torch.Tensor:
    return x * x * x


@torch.library.custom_op("tpu_agent_test::square", mutates_args=())
def square(x: torch.Tensor) -> torch.Tensor:
    return x * x


def test_a_custom_op_for_every_device_runs_its_kernel_on_tpu(monkeypatch):
    monkeypatch.delenv("TPU_AGENT_CPU_FALLBACK", raising=False)
    a = torch.randn(2, 3)
    before = STATS.fallbacks["tpu_agent_test.square.default"]
    out = square(a.to("tpu"))
    assert out.device.type == "tpu"
    torch.testing.assert_close(out.cpu(), a * a)
    assert STATS.fallbacks["tpu_agent_test.square.default"] == before  # its aten ops ran on the device, no fallback


def test_unsupported_op_names_the_op_and_shapes(monkeypatch):
    monkeypatch.delenv("TPU_AGENT_CPU_FALLBACK", raising=False)
    x = torch.ones(1, 2, 3, device="tpu")
    with pytest.raises(NotImplementedError, match=r"tpu_agent_test\.cube\.default.*tpu:\[1, 2, 3\]:float32"):
        cube(x)
    with pytest.raises(NotImplementedError, match=r"aten op aten\._cslt_compress\.default is not supported"):
        torch.ops.aten._cslt_compress(torch.ones(4, 8, device="tpu"))


def test_cpu_fallback_is_opt_in_and_counted(monkeypatch):
    monkeypatch.setenv("TPU_AGENT_CPU_FALLBACK", "1")
    a = torch.randn(2, 3)
    before = STATS.fallbacks["tpu_agent_test.cube.default"]
    out = cube(a.to("tpu"))
    assert out.device.type == "tpu"
    torch.testing.assert_close(out.cpu(), a * a * a)
    assert STATS.fallbacks["tpu_agent_test.cube.default"] == before + 1


def test_launch_blocking_and_default_modes_agree():
    x = torch.randn(64, 64).to("tpu")
    expected = (x @ x).sum().item()
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING):
        assert (x @ x).sum().item() == expected
