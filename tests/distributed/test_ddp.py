"""examples/ddp.py (DistributedDataParallel, DistributedSampler, no_sync() accumulation) at world size 2:
launched by `tpu-agent run --nproc 2` on the tpu device, it matches the same script on the CPU with gloo and
the tool off, rank by rank (per-step losses and final parameters within 1e-5 relative); and a rank that
raises stops the job with its traceback and exit status, its partner blocked in a collective included."""

from __future__ import annotations

import math
import textwrap

import pytest

from support.processes import run_tool
from support.rank_runs import run_ranks

STEPS = 6


def _close(a: float, b: float, rel: float = 1e-5) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=rel * 1e-2)


@pytest.mark.slow  # two 2-rank jobs (about 35 s)
def test_the_ddp_example_on_tpu_under_tpu_agent_run_nproc_2_matches_cpu_gloo_rank_by_rank(tmp_path):
    args = ["--steps", str(STEPS)]
    runs = {on: run_ranks("ddp.py", args, tmp_path / on, on=on) for on in ("tpu", "cpu")}
    for rank in (0, 1):
        tpu, cpu = runs["tpu"][rank], runs["cpu"][rank]
        assert len(tpu["losses"]) == len(cpu["losses"]) == STEPS
        assert all(_close(a, b) for a, b in zip(tpu["losses"], cpu["losses"])), (rank, tpu["losses"], cpu["losses"])
        assert tpu["params"].keys() == cpu["params"].keys()
        for name, values in tpu["params"].items():
            assert all(_close(a, b) for a, b in zip(values, cpu["params"][name])), (rank, name)
    # The ranks saw different data (their own shards) and still hold one model: gradients were all-reduced.
    assert runs["tpu"][0]["losses"] != runs["tpu"][1]["losses"]
    assert runs["tpu"][0]["params"] == runs["tpu"][1]["params"]


FAILING = textwrap.dedent("""
    import torch, torch.distributed as dist
    dist.init_process_group()
    rank = dist.get_rank()
    x = torch.ones(2, device="tpu")
    dist.all_reduce(x)
    print(f"rank {rank} reduced {x.sum().item()}", flush=True)
    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.all_reduce(x)  # rank 1 never joins
    print("rank 0 went on", flush=True)
""")

EXITING = textwrap.dedent("""
    import sys, torch.distributed as dist
    dist.init_process_group()
    dist.barrier()
    sys.exit(5 if dist.get_rank() == 1 else 0)
""")


@pytest.mark.slow  # two 2-rank jobs (about 25 s)
def test_a_rank_that_raises_stops_the_job_with_its_traceback_and_the_launcher_gives_its_exit_status(tmp_path):
    (tmp_path / "failing.py").write_text(FAILING)
    proc = run_tool("run", "--nproc", "2", "failing.py", cwd=tmp_path, timeout=150)  # JAX's exit barrier held it 5 min
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "rank 0 reduced 4.0" in proc.stdout and "rank 1 reduced 4.0" in proc.stdout
    assert "ValueError: boom on rank 1" in proc.stderr
    assert "rank 0 went on" not in proc.stdout
    (tmp_path / "exiting.py").write_text(EXITING)  # CPU only: torchrun says 1, the rank said 5
    proc = run_tool("run", "--nproc", "2", "exiting.py", cwd=tmp_path, timeout=150)
    assert proc.returncode == 5, proc.stderr[-3000:]
    assert "exitcode  : 5" in proc.stderr
