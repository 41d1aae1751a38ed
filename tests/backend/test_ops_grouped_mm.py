"""`torch.nn.functional.grouped_mm` (aten._grouped_mm) on the tpu device against the CPU.

Every layout PyTorch accepts, forward and gradients (autograd's backward calls
_grouped_mm again, with transposed operands and the 2d x 2d layout for the weight
gradient). PyTorch leaves rows (2d x 3d) or columns (3d x 2d) past the last offset
uninitialized, so only the covered part is compared; the tpu device makes them zeros.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

RTOL, ATOL = 1e-4, 1e-5


def _randn(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def _offs(*ends):
    return torch.tensor(ends, dtype=torch.int32)


def _run(a, b, offs, device, covered, **kwargs):
    """The output and the gradients of a loss that weights the covered part of it."""
    a = a.detach().to(device).requires_grad_(True)
    b = b.detach().to(device).requires_grad_(True)
    out = F.grouped_mm(a, b, offs=offs.to(device) if offs is not None else None, **kwargs)
    part = out[covered]
    w = _randn(*part.shape, seed=99, dtype=out.dtype).to(device)
    (part * w).sum().backward()
    return out.detach().cpu(), a.grad.cpu(), b.grad.cpu()


# (mat_a, mat_b, offs, covered part of the output, of grad a, of grad b)
CASES = {
    # tokens sorted by expert, one weight per expert; the last 3 rows belong to no group
    "2d_3d": (_randn(13, 8), _randn(3, 8, 4, seed=1), _offs(2, 6, 10), (slice(0, 10),), (slice(0, 10),), ()),
    "2d_3d_empty_group": (_randn(8, 8), _randn(4, 8, 4, seed=1), _offs(3, 3, 8, 8), (), (), ()),
    # the weight gradient's layout: K split into groups
    "2d_2d": (_randn(4, 12), _randn(12, 8, seed=1), _offs(2, 5, 12), (), (), ()),
    "2d_2d_short": (_randn(4, 12), _randn(12, 8, seed=1), _offs(3, 3, 9), (), (slice(None), slice(0, 9)),
                    (slice(0, 9),)),
    "3d_2d": (_randn(3, 4, 8), _randn(8, 12, seed=1), _offs(4, 8, 12), (), (), ()),
    "3d_2d_short": (_randn(3, 4, 8), _randn(8, 12, seed=1), _offs(4, 4, 8), (slice(None), slice(0, 8)), (),
                    (slice(None), slice(0, 8))),
    "3d_3d": (_randn(2, 4, 8), _randn(2, 8, 4, seed=1), None, (), (), ()),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_grouped_mm_forward_and_gradients_match_cpu(case):
    a, b, offs, *covered = CASES[case]
    cpu = _run(a, b, offs, "cpu", covered[0])
    tpu = _run(a, b, offs, "tpu", covered[0])
    for what, got, want, part in zip(("output", "grad a", "grad b"), tpu, cpu, covered):
        torch.testing.assert_close(got[part], want[part], rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def test_grouped_mm_uncovered_rows_are_zero():
    a, b, offs, covered, *_ = CASES["2d_3d"]
    out, grad_a, _ = _run(a, b, offs, "tpu", covered)
    assert torch.equal(out[10:], torch.zeros(3, 4))
    assert torch.equal(grad_a[10:], torch.zeros(3, 8))
    a, b, offs, covered, *_ = CASES["3d_2d_short"]
    out, _, grad_b = _run(a, b, offs, "tpu", covered)
    assert torch.equal(out[:, 8:], torch.zeros(4, 4))
    assert torch.equal(grad_b[:, 8:], torch.zeros(8, 4))
    a, b, offs, covered, *_ = CASES["2d_2d_short"]
    out, grad_a, grad_b = _run(a, b, offs, "tpu", covered)
    assert torch.equal(out[1], torch.zeros(4, 8))  # an empty group
    assert torch.equal(grad_a[:, 9:], torch.zeros(4, 3))
    assert torch.equal(grad_b[9:], torch.zeros(3, 8))


def test_grouped_mm_transposed_weight_matches_cpu():
    """Hugging Face's `is_transposed` experts: weights stored (G, N, K), used transposed."""
    x, w, offs = _randn(10, 8), _randn(3, 16, 8, seed=1), _offs(4, 4, 10)

    def run(device):
        xt = x.to(device).requires_grad_(True)
        wt = w.to(device).requires_grad_(True)
        out = F.grouped_mm(xt, wt.transpose(-2, -1), offs=offs.to(device))
        (out * _randn(10, 16, seed=5).to(device)).sum().backward()
        return out.detach().cpu(), xt.grad.cpu(), wt.grad.cpu()

    for got, want in zip(run("tpu"), run("cpu")):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("fused", [False, True])
def test_grouped_mm_bfloat16_matches_cpu(fused):
    """bf16, what MoE models run, eager and fused into graphs."""
    a, b, offs = _randn(12, 16, dtype=torch.bfloat16), _randn(3, 16, 8, seed=1, dtype=torch.bfloat16), _offs(4, 8, 12)
    covered = (slice(None),)
    mode = torch.tpu.EagerMode.DEFER_AND_FUSE if fused else torch.tpu.get_eager_mode()
    with torch.tpu.set_eager_mode(mode):
        got = _run(a, b, offs, "tpu", covered)
        plain = F.grouped_mm(a.to("tpu"), b.to("tpu"), offs=offs.to("tpu"), out_dtype=torch.bfloat16).cpu()
    want = _run(a, b, offs, "cpu", covered)
    assert got[0].dtype == torch.bfloat16
    for what, g, w in zip(("output", "grad a", "grad b"), got, want):
        torch.testing.assert_close(g, w, msg=lambda m: f"{what}: {m}")
    torch.testing.assert_close(plain, want[0])


def test_grouped_mm_rejects_what_pytorch_rejects():
    a, b = _randn(8, 8).to("tpu"), _randn(3, 8, 4, seed=1).to("tpu")
    with pytest.raises(RuntimeError):
        F.grouped_mm(a, b, offs=_offs(2, 5).to("tpu"))  # one offset per group
    with pytest.raises(RuntimeError):
        F.grouped_mm(a, b)  # 2d operands need offsets


def test_moe_experts_with_grouped_mm_match_cpu():
    """A tiny Qwen3-MoE whose experts run through grouped_mm: loss and gradients as on the CPU."""
    from support.hf_models import qwen3_moe

    model_cls, cfg, batch = qwen3_moe()
    cfg._experts_implementation = "grouped_mm"

    def run(device):
        torch.manual_seed(0)
        model = model_cls(cfg).to(device)
        out = model(**{k: v.to(device) for k, v in batch.items()})
        out.loss.backward()
        grads = {n: p.grad.cpu() for n, p in model.named_parameters() if p.grad is not None}
        return out.loss.detach().cpu(), grads

    cpu_loss, cpu_grads = run("cpu")
    tpu_loss, tpu_grads = run("tpu")
    torch.testing.assert_close(tpu_loss, cpu_loss, rtol=RTOL, atol=ATOL)
    assert tpu_grads.keys() == cpu_grads.keys()
    assert any("experts" in n for n in cpu_grads)
    for name, want in cpu_grads.items():
        torch.testing.assert_close(tpu_grads[name], want, rtol=1e-3, atol=1e-5, msg=lambda m: f"grad of {name}: {m}")
