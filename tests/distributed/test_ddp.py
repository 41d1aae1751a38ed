"""examples/ddp.py (DistributedDataParallel, DistributedSampler, no_sync() accumulation) at world size 2:
launched by `tpu-agent run --nproc 2` on the tpu device, it matches the same script on the CPU with gloo and
the tool off, rank by rank (per-step losses and final parameters within 1e-5 relative), under compiled steps;
and a rank that raises stops the job with its traceback and exit status, its partner blocked in a collective
included (tests/distributed/test_rank_faults.py)."""

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
@pytest.mark.matrix  # the default pass: DDP under compiled steps trains as the same model on the CPU does
# (tests/distributed/test_collectives.py, in its 2-rank job); examples/ddp.py under `tpu-agent run --nproc 2` against
# gloo eagerly, as a GPU script writes it (tests/distributed/test_device_map_nccl.py)
def test_the_ddp_example_on_tpu_under_tpu_agent_run_nproc_2_matches_cpu_gloo_rank_by_rank(tmp_path):
    """Compiled (TPU_AGENT_COMPILE_STEPS=1: the model's forward and backward and the optimizer's update as
    compiled programs, the all-reduces between them; measured 2026-12-04: losses 8.9e-8 relative, parameters
    7.3e-8 of their norm). Eager DDP on the same model and data: tests/distributed/test_device_map_nccl.py
    (this example as a GPU script writes it, --device cuda); this example eager, in the release
    matrix (tests/distributed/test_scripts.py, ddp-eager-2)."""
    args = ["--steps", str(STEPS)]
    cpu = run_ranks("ddp.py", args, tmp_path / "cpu", on="cpu")
    for mode, env in (("compiled", {"TPU_AGENT_COMPILE_STEPS": "1"}),):
        tpu = run_ranks("ddp.py", args, tmp_path / mode, on="tpu", env=env)
        for rank in (0, 1):
            mine, ref = tpu[rank], cpu[rank]
            assert len(mine["losses"]) == len(ref["losses"]) == STEPS
            assert all(_close(a, b) for a, b in zip(mine["losses"], ref["losses"])), (mode, rank, mine["losses"], ref["losses"])
            assert mine["params"].keys() == ref["params"].keys()
            for name, values in mine["params"].items():
                assert all(_close(a, b) for a, b in zip(values, ref["params"][name])), (mode, rank, name)
        # The ranks saw different data (their own shards) and still hold one model: gradients were all-reduced.
        assert tpu[0]["losses"] != tpu[1]["losses"]
        assert tpu[0]["params"] == tpu[1]["params"]


EXITING = textwrap.dedent("""
    import sys, torch.distributed as dist
    dist.init_process_group()
    dist.barrier()
    sys.exit(5 if dist.get_rank() == 1 else 0)
""")


@pytest.mark.slow  # a 2-rank job (about 10 s)
def test_the_launcher_gives_the_exit_status_a_rank_exited_with(tmp_path):
    """A rank that raises while its partner waits in a collective: tests/distributed/test_rank_faults.py."""
    (tmp_path / "exiting.py").write_text(EXITING)  # CPU only: torchrun says 1, the rank said 5
    proc = run_tool("run", "--nproc", "2", "exiting.py", cwd=tmp_path, timeout=150)
    assert proc.returncode == 5, proc.stderr[-3000:]
    assert "exitcode  : 5" in proc.stderr


ONE_RANK = textwrap.dedent("""
    import os, torch, torch.distributed as dist
    dist.init_process_group()
    x = torch.ones(2, device="tpu")
    dist.all_reduce(x)
    print(f"world {dist.get_world_size()} rank {dist.get_rank()} local {os.environ['LOCAL_RANK']} sum {x.sum().item()}")
    for _ in range(2):
        torch.optim.SGD([torch.nn.Parameter(x.clone())], lr=0.1).step()  # steps for the profiler to find
    dist.destroy_process_group()
""")


def test_nproc_1_runs_and_profiles_a_torchrun_script_as_one_rank(tmp_path):
    """A torchrun script debugged at one rank: `--nproc 1` gives it a group of one, as `torchrun
    --nproc-per-node 1` would; without --nproc it runs as `python` would (no group: the script's own error)."""
    (tmp_path / "one.py").write_text(ONE_RANK)
    proc = run_tool("run", "--nproc", "1", "one.py", cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "world 1 rank 0 local 0 sum 2.0" in proc.stdout
    proc = run_tool("profile", "--nproc", "1", "one.py", "--steps", "1", "--warmup", "1", cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "world 1 rank 0" in proc.stdout + proc.stderr
    proc = run_tool("run", "one.py", cwd=tmp_path, timeout=120)
    assert proc.returncode == 1 and "environment variable RANK expected" in proc.stderr
