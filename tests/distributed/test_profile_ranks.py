"""`tpu-agent profile --nproc 2`: every rank profiled, gathered into one profile.json and its text report (per-rank
step time and peak memory, each collective's op, bytes, count and time, the communication share, the slowest
rank), and `tpu-agent diff` on two such profiles (the second: the first with twice its all-reduced bytes), or on
one and a single-process profile. Issue #26 point 5."""

from __future__ import annotations

import copy
import json
import textwrap

import pytest

from support.processes import one_error_line, run_tool

# Each step all-reduces a float32 tensor of SIZE elements (SIZE * 4 bytes) and all-gathers 3 float32 per rank
# (2 * 3 * 4 = 24 bytes gathered): nothing else is a collective, so the recorded bytes are known exactly. Rank 1
# sleeps outside its collectives: it is the slowest rank, and rank 0 spends that time waiting in a collective.
SCRIPT = textwrap.dedent("""
    import sys, time
    import torch, torch.distributed as dist
    size = int(sys.argv[1])
    dist.init_process_group()
    torch.tpu.set_device(0)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2).to("tpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(20):
        loss = model(torch.randn(4, 8).to("tpu")).pow(2).mean()
        loss.backward()
        buf = torch.ones(size, device="tpu")
        dist.all_reduce(buf)
        out = torch.empty(6, device="tpu")
        dist.all_gather_into_tensor(out, torch.full((3,), float(dist.get_rank()), device="tpu"))
        if dist.get_rank() == 1:
            time.sleep(0.1)  # the straggler: rank 0 waits for it in its next collective
        opt.step()
        opt.zero_grad()
""")
PROFILE = ("profile", "--nproc", "2", "--steps", "3", "--warmup", "1", "--host-device-steps", "0", "--no-dump-hlo")


def _profile(tmp_path, size: int, out: str):
    proc = run_tool(*PROFILE, "-o", out, "train.py", "--", str(size), cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = (tmp_path / out).iterdir()
    return proc, run_dir, json.loads((run_dir / "profile.json").read_text())


def _collective(rank: dict, op: str) -> dict:
    (found,) = [c for c in rank["collectives"] if c["op"] == op]
    return found


@pytest.mark.slow  # a 2-rank profile
def test_profile_nproc_2_gathers_every_rank_and_diff_compares_them(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    proc, run_dir, prof = _profile(tmp_path, 1000, "a")
    d = prof["distributed"]
    assert d["world_size"] == 2 and d["missing_ranks"] == []
    assert [r["rank"] for r in d["ranks"]] == [0, 1]
    for rank in d["ranks"]:
        assert (run_dir / "ranks" / f"rank{rank['rank']}" / "profile.json").is_file()
        assert rank["status"] == "stopped" and rank["step_time"]["median_s"] > 0
        assert rank["live_peak_bytes"] >= 4000  # the all-reduced buffer was alive at a step boundary
        reduce = _collective(rank, "all_reduce")
        assert reduce["ranks"] == [0, 1] and reduce["calls_per_step"] == 1.0
        assert reduce["bytes_per_call"] == 4000 and reduce["bytes"] == 4000 * reduce["count"]
        gather = _collective(rank, "all_gather")
        assert gather["bytes_per_call"] == 24 and gather["calls_per_step"] == 1.0
        assert reduce["time_s"] > 0 and gather["time_s"] > 0
        assert 0 < rank["comm_share"] < 1
        assert rank["comm_s_per_step"] == pytest.approx(reduce["time_per_step_s"] + gather["time_per_step_s"])
    assert 0 < d["comm_share"] < 1
    assert d["slowest_rank"]["rank"] == 1  # it sleeps 100 ms a step outside collectives; rank 0 waits in them
    assert d["ranks"][0]["comm_s_per_step"] > 0.05
    assert "distributed: 2 ranks" in proc.stdout and "slowest rank: rank " in proc.stdout
    assert "all_reduce" in proc.stdout and "3.91 KiB" in proc.stdout  # the collectives table: bytes per call

    # The head: the same profile with twice the all-reduced bytes (the bytes a rank records are SIZE * 4, exactly,
    # as above; diff reads the two profile.json files and nothing else of their runs).
    prof_b = copy.deepcopy(prof)
    for rank in prof_b["distributed"]["ranks"]:
        reduce = _collective(rank, "all_reduce")
        for field in ("bytes_per_call", "bytes", "bytes_per_step"):
            reduce[field] *= 2
    (tmp_path / "b.json").write_text(json.dumps(prof_b))
    diff = run_tool("diff", str(run_dir / "profile.json"), "b.json", cwd=tmp_path)
    assert diff.returncode == 0, diff.stderr
    assert "#### Distributed runs" in diff.stdout
    assert "| rank 0: all_reduce over 0,1: bytes / step | 3.91 KiB | 7.81 KiB | +100.0% |" in diff.stdout
    assert "| rank 1: communication share |" in diff.stdout and "| slowest rank | rank " in diff.stdout

    single = dict(prof_b, distributed=None)  # a profile of one process: rank 1's own, without its rank section
    (tmp_path / "single.json").write_text(json.dumps(single))
    diff = run_tool("diff", str(run_dir / "profile.json"), "single.json", cwd=tmp_path)
    assert diff.returncode == 0, diff.stderr
    assert "**Only the base is a distributed run** (2 ranks)" in diff.stdout
    assert "rank 0: step time" not in diff.stdout


def test_profile_nproc_0_or_with_devices_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    for args in (("--nproc", "0"), ("--nproc", "2", "--devices", "2")):
        proc = run_tool("profile", *args, "train.py", cwd=tmp_path, timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert "--nproc" in one_error_line(proc)
    assert not (tmp_path / ".tpu-agent").exists()


def _rank_profile(tmp_path, rank: int, step_s: float, comm_s: float):
    """A rank's own profile as its session writes it, with one measured step."""
    from datetime import datetime, timezone

    from tpu_agent.profilers.ranks import rank_dir
    from tpu_agent.profilers.schema import (CollectiveStat, Distributed, Profile, RankProfile, Settings, Steps,
                                            StepStats, write_profile)

    stats = StepStats(count=1, median_s=step_s, p10_s=step_s, p90_s=step_s, mean_s=step_s, basis="one step")
    reduce = CollectiveStat(op="all_reduce", ranks=[0, 1, 2], count=1, calls_per_step=1, bytes=8, bytes_per_call=8,
                            bytes_per_step=8, time_s=comm_s, time_per_step_s=comm_s)
    entry = RankProfile(rank=rank, status="complete", exit_code=0, step_time=stats, comm_s_per_step=comm_s,
                        comm_share=comm_s / step_s, compute_s_per_step=step_s - comm_s, collectives=[reduce])
    prof = Profile(status="complete", exit_code=0, created_at=datetime.now(timezone.utc), script="train.py", args=[],
                   cwd=str(tmp_path), run_dir=str(rank_dir(tmp_path, rank)), settings=Settings(), mode_used="fused",
                   steps=Steps(markers=["optimizer"], stats=stats),
                   distributed=Distributed(world_size=3, ranks=[entry]))
    rank_dir(tmp_path, rank).mkdir(parents=True)
    write_profile(prof, rank_dir(tmp_path, rank) / "profile.json")


def test_gather_names_the_missing_rank_and_the_slowest_by_its_time_outside_collectives(tmp_path):
    """Rank 0's step is the longest on the wall, but it spent it waiting in its collective: rank 1 is slowest."""
    from tpu_agent.profilers.ranks import gather

    _rank_profile(tmp_path, 0, step_s=0.30, comm_s=0.20)
    _rank_profile(tmp_path, 1, step_s=0.25, comm_s=0.01)
    merged = gather(tmp_path, 3, exit_code=1)
    d = merged.distributed
    assert [r.rank for r in d.ranks] == [0, 1] and d.missing_ranks == [2]
    assert d.slowest_rank.rank == 1 and d.slowest_rank.spread == pytest.approx(0.24 / 0.10 - 1)
    assert d.step_time_s == 0.30 and d.comm_share == pytest.approx((0.20 / 0.30 + 0.01 / 0.25) / 2)
    assert merged.status == "failed" and merged.exit_code == 1
    assert any("rank(s) 2 wrote no profile" in n for n in merged.notes)
