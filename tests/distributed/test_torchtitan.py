"""TorchTitan 0.3.0 (the `titan` extra) trains its Llama 3 debug model on tpu (issue #26 point 7).

TorchTitan picks its device with torch's `_get_available_device_type()` (cuda, mps, xpu, mtia, then the
PrivateUse1 backend's module if its `is_available()`) and its process-group backend from
`Backend.default_device_backend_map[device]`: in the tool's child that is tpu and the `tpu` backend. The
calls where TorchTitan 0.3.0 assumes CUDA or a newer PyTorch, each checked here as needed (TorchTitan's own
source makes it) and working on tpu: see docs/training-stacks.md. The slow test trains through TorchTitan's
own train.py: a seed checkpoint (TorchTitan's way to start runs of different parallelism from the same
weights), then 1 rank and FSDP over 2 ranks (torchrun), per-step losses within 1e-4, on a tokenizer and a
text dataset made here."""

from __future__ import annotations

import importlib.util
import inspect
import textwrap

import pytest
import torch

from support.processes import clean_env, run_python, run_tool
from support.titan_assets import documents, write_dataset, write_tokenizer

# The release matrix (docs/ci.md): TorchTitan 0.3.0 imports triton, a 286 MB download the default set-up leaves
# out. `-m matrix` runs these tests, after `SETUP_EXTRAS=test,titan bash scripts/setup.sh` installed the extra.
pytestmark = pytest.mark.matrix


@pytest.fixture(autouse=True)
def _titan_installed():
    if importlib.util.find_spec("torchtitan") is None:
        pytest.fail("the titan extra is not installed: SETUP_EXTRAS=test,titan bash scripts/setup.sh (docs/ci.md)")

FINDS_DEVICE = textwrap.dedent("""
    import torch
    from torch._utils import _get_available_device_type
    from torchtitan.tools import utils
    print(_get_available_device_type(), torch.distributed.Backend.default_device_backend_map.get("tpu"),
          utils.device_type, utils.device_module is getattr(torch, "tpu", None))
""")


def test_torchtitan_finds_tpu_in_the_tools_child_only(tmp_path):
    """Its device and backend at import: tpu in `tpu-agent run`; under plain python with the tool installed
    torch.tpu.is_available() is False until an op runs on tpu, so TorchTitan falls back to "cuda", as before
    the tool was installed."""
    (tmp_path / "finds.py").write_text(FINDS_DEVICE)
    tool = run_tool("run", "-q", "finds.py", cwd=tmp_path, timeout=300)
    assert tool.returncode == 0, tool.stderr[-3000:]
    assert tool.stdout.split() == ["tpu", "tpu", "tpu", "True"], tool.stdout
    plain = run_python("finds.py", cwd=tmp_path, env=clean_env(), timeout=300)
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert plain.stdout.split() == ["None", "tpu", "cuda", "False"], plain.stdout


def test_set_timeout_torchtitan_calls_is_there_under_the_tool_only(tmp_path):
    """TorchTitan calls torch.distributed.set_timeout after its first step (on any device); PyTorch 2.13 has
    only the private _set_pg_timeout, which the tool's child names publicly. A script run without the tool
    sees torch.distributed as it is."""
    from torch.distributed import distributed_c10d
    from torchtitan.distributed import utils as titan_dist

    assert "torch.distributed.set_timeout(" in inspect.getsource(titan_dist.set_pg_timeouts)
    assert not hasattr(distributed_c10d, "set_timeout")  # torch itself lacks it: the name is the tool's
    (tmp_path / "names.py").write_text(
        "import torch.distributed as dist\n"
        "print(getattr(dist, 'set_timeout', None) is dist.distributed_c10d._set_pg_timeout)\n")
    tool = run_tool("run", "-q", "names.py", cwd=tmp_path, timeout=300)
    assert tool.returncode == 0, tool.stderr[-3000:]
    assert tool.stdout.split()[-1:] == ["True"], tool.stdout
    plain = run_python("names.py", cwd=tmp_path, env=clean_env(), timeout=300)
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert plain.stdout.split() == ["False"], plain.stdout


def test_dtensor_rng_reads_the_device_state_as_cuda_philox():
    """FSDP2 parameters are DTensors, and DTensor's RNG tracker (TorchTitan's init_weights) reads
    torch.tpu.get_rng_state() as CUDA's 16-byte Philox state, seed then offset, and moves the offset."""
    from torch.distributed.tensor._random import _PhiloxState

    torch.manual_seed(3)
    state = _PhiloxState(torch.tpu.get_rng_state())
    assert state.seed.item() == 3 and state.offset.item() == 0
    first = torch.rand(4, device="tpu").cpu()
    state.offset = torch.tensor([40], dtype=torch.int64)
    torch.tpu.set_rng_state(state.state)
    assert _PhiloxState(torch.tpu.get_rng_state()).offset.item() == 40
    assert not torch.equal(torch.rand(4, device="tpu").cpu(), first)  # another offset, other numbers
    state.offset = torch.tensor([0], dtype=torch.int64)
    torch.tpu.set_rng_state(state.state)
    assert torch.equal(torch.rand(4, device="tpu").cpu(), first)
    ranks_agree = torch.tpu.get_rng_state().to("tpu") == torch.tpu.get_rng_state().to("tpu")
    assert all(ranks_agree)  # the tracker's check: bool() of tpu tensors (aten.item)


def test_assert_async_checks_on_tpu():
    """TorchTitan's RoPE checks positions with torch._assert_async (CUDA raises at a later launch); on tpu
    the value is read at once."""
    from torchtitan.models.common import rope

    assert "torch._assert_async(" in inspect.getsource(rope._maybe_check_max_pos)
    positions = torch.arange(8, device="tpu")
    torch._assert_async(torch.all(positions <= 7), "position_ids exceed 7")
    with pytest.raises(RuntimeError, match="position_ids exceed 6"):
        torch._assert_async(torch.all(positions <= 6), "position_ids exceed 6")


def test_varlen_attention_matches_attention_per_document():
    """TorchTitan's varlen backend (torch.nn.attention.varlen_attn: documents packed in [T, N, H], bounded by
    cumulative lengths) reaches aten._flash_attention_forward/backward, CUDA kernels lowered here: against
    causal attention run per document on the CPU, values and gradients."""
    import torch.nn.functional as F
    from torch.nn.attention.varlen import varlen_attn

    from torchtitan.models.common.attention import VarlenAttention

    assert "varlen_attn(" in inspect.getsource(VarlenAttention.forward)
    torch.manual_seed(0)
    bounds = [0, 5, 8, 16]
    q, k, v = (torch.randn(16, 4, 8) for _ in range(3))
    cpu = [x.clone().requires_grad_() for x in (q, k, v)]
    reference = torch.cat([
        F.scaled_dot_product_attention(*(x[s:e].transpose(0, 1) for x in cpu), is_causal=True).transpose(0, 1)
        for s, e in zip(bounds[:-1], bounds[1:])])
    (reference * torch.linspace(-1, 1, 8)).sum().backward()
    tpu = [x.to("tpu").detach().requires_grad_() for x in (q, k, v)]
    cu = torch.tensor(bounds, dtype=torch.int32, device="tpu")
    out = varlen_attn(*tpu, cu, cu, 8, 8, window_size=(-1, 0))
    (out * torch.linspace(-1, 1, 8, device="tpu")).sum().backward()
    torch.testing.assert_close(out.cpu(), reference.detach(), atol=2e-6, rtol=2e-6)
    for mine, theirs in zip(tpu, cpu):
        torch.testing.assert_close(mine.grad.cpu(), theirs.grad, atol=2e-6, rtol=2e-6)


PREMUL_SUM = textwrap.dedent("""
    import torch, torch.distributed as dist
    from torch.distributed import ReduceOp
    dist.init_process_group()
    rank = dist.get_rank()
    t = torch.tensor([1.0, 2.0], device="tpu") * (rank + 1)
    dist.all_reduce(t, op=ReduceOp.PREMUL_SUM(0.5))
    out = torch.empty(2, device="tpu")
    dist.reduce_scatter_tensor(out, torch.arange(4.0, device="tpu") * (rank + 1), op=ReduceOp.PREMUL_SUM(0.25))
    open(f"rank{rank}.txt", "w").write(f"{t.tolist()} {out.tolist()}")
    dist.destroy_process_group()
""")


@pytest.mark.slow  # torchrun, 2 ranks
def test_premul_sum_scales_then_sums(tmp_path):
    """FSDP2 reduce-scatters gradients with ReduceOp.PREMUL_SUM(1 / factor) once a gradient divide factor is
    set, as TorchTitan does (1.0): each rank's input times the factor, then summed."""
    from torchtitan.distributed import fsdp

    assert "set_gradient_divide_factor(1.0)" in inspect.getsource(fsdp)
    (tmp_path / "premul.py").write_text(PREMUL_SUM)
    proc = run_tool("run", "-q", "--nproc", "2", "premul.py", cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "rank0.txt").read_text() == "[1.5, 3.0] [0.0, 0.75]"
    assert (tmp_path / "rank1.txt").read_text() == "[1.5, 3.0] [1.5, 2.25]"


@pytest.mark.slow
def test_llama3_debug_model_fsdp_2_ranks_matches_1_rank(tmp_path):
    """TorchTitan's train.py: a seed checkpoint (1 rank, CPU init), then 2 steps from it on 1 rank (batch 4)
    and with FSDP over 2 ranks (batch 2 each, through torchrun). Each text is one 32-token sample; the 1-rank
    file puts each step's 4 texts where the 2 ranks' contiguous halves of theirs have them, so every step
    sees the same 4 samples. float32 parameters: the loss then differs only in summation order. Step 1 checks the
    sharded forward, step 2 the averaged gradients and the update (a third step checked nothing new)."""
    from support.titan_runs import losses, train  # imports torchtitan

    write_tokenizer(tmp_path / "tokenizer")
    texts = documents(16, 31)
    write_dataset(tmp_path / "data2", texts)  # rank 0 reads texts 0-7, rank 1 texts 8-15, 2 per step
    write_dataset(tmp_path / "data1", [t for s in range(4) for t in texts[2 * s:2 * s + 2] + texts[8 + 2 * s:10 + 2 * s]])
    common = ["--hf-assets-path", "tokenizer", "--training.seq-len", "32", "--training.steps", "2",
              "--training.mixed-precision-param", "float32"]
    seed = train(tmp_path, [*common, "--dataloader.dataset-path", "data1", "--dump-folder", "seed",
                            "--checkpoint.enable", "--checkpoint.create-seed-checkpoint",
                            "--parallelism.data-parallel-shard-degree", "1"])
    assert seed.returncode == 0, seed.stderr[-4000:]
    start = ["--checkpoint.enable", "--checkpoint.load-only",
             "--checkpoint.initial-load-path", str(tmp_path / "seed" / "checkpoint" / "step-0")]
    one = train(tmp_path, [*common, *start, "--dataloader.dataset-path", "data1", "--dump-folder", "one",
                           "--training.local-batch-size", "4"])
    assert one.returncode == 0, one.stderr[-4000:]
    two = train(tmp_path, [*common, *start, "--dataloader.dataset-path", "data2", "--dump-folder", "two",
                           "--training.local-batch-size", "2"], nproc=2)
    assert two.returncode == 0, two.stderr[-4000:]
    assert "Loading the checkpoint from" in one.stdout + one.stderr and "dp_shard=2" in two.stdout + two.stderr
    one_losses, two_losses = losses(one), losses(two, rank_lines=2)
    assert list(one_losses) == [1, 2] and list(two_losses) == [1, 2]
    worst = max(abs(one_losses[s] - two_losses[s]) for s in one_losses)
    print(f"1 rank {one_losses}, 2 ranks {two_losses}: worst {worst:.2e}")
    assert worst <= 1e-4, (one_losses, two_losses)
