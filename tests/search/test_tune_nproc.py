"""`tpu-agent tune --nproc N`: the baseline, every trial and the verification run the script at N ranks under
PyTorch's launcher; a step is timed as its slowest rank's, each rank's losses are checked against the baseline's
same rank, each rank's memory is measured, a rank's crash is a failed trial."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import optuna
import pytest

from support.processes import clean_env, one_error_line, run_tool
from tpu_agent.config import TuneOptions
from tpu_agent.measure.context import Measuring
from tpu_agent.measure.compare import Comparison, aligned_losses, losses_by_step, rank_memory_line
from tpu_agent.measure.runner import Runner
from tpu_agent.measure.trials import RankedStep, StepRecord, TrialFailed, TrialProcess, rank_records
from tpu_agent.plan.actions import FsdpReshard, Mesh, PadOps, Plan
from tpu_agent.verify.verdict import resharded_on_cpu_ranks, simulated_devices_only, verify

# A DDP script as users write it, each rank on its own data (their losses differ). With RANKS_COUNTER set, rank 0
# counts the jobs started (the tune's baseline profile, its warm baseline, then the candidates) and rank 1 of the
# third job on raises at step 3: every trial's candidate crashes on one rank.
DDP = textwrap.dedent("""
    import os
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    dist.init_process_group()
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(24, 4).to("tpu"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(8, 24, generator=g).to("tpu"), torch.randint(0, 4, (8,), generator=g).to("tpu")
    crash = False
    counter = os.environ.get("RANKS_COUNTER")
    if counter:
        if rank == 0:
            with open(counter, "a") as f:
                f.write("job\\n")
        dist.barrier()
        crash = rank == 1 and len(open(counter).read().split()) >= 3
    for step in range(int(os.environ.get("STEPS", "200"))):
        if crash and step == 3:
            raise RuntimeError("boom on rank 1")
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    dist.destroy_process_group()
""")


def _steps(losses: list[tuple[float, float]], walls: list[tuple[float, float]], memory=(1000, 2000)) -> list:
    return [RankedStep.of([StepRecord(step=i + 1, wall_s=w, loss=l, device_bytes=m)
                           for w, l, m in zip(wall, loss, memory)])
            for i, (loss, wall) in enumerate(zip(losses, walls))]


def test_a_ranked_step_is_its_slowest_rank_and_each_rank_is_checked_against_its_own():
    base = _steps([(2.0, 3.0)] * 6, [(0.010, 0.020)] * 6)
    assert [s.wall_s for s in base] == [0.020] * 6 and base[0].loss == 2.0 and base[0].device_bytes == 2000
    assert [r.loss for r in rank_records(base[0])] == [2.0, 3.0]
    known = losses_by_step(base)
    assert known[(1, 0)] == 2.0 and known[(1, 1)] == 3.0

    same = _steps([(2.0, 3.0)] * 6, [(0.005, 0.010)] * 6, memory=(500, 1000))
    compared = Comparison(base, same, Plan(), TuneOptions(), losses=aligned_losses(known, same))
    check, _ = compared.numerics()
    assert check.passed and check.reason.startswith("each of the 2 ranks against the baseline's same rank")
    assert compared.ratio == pytest.approx(2.0)  # 0.020 / 0.010: the slowest ranks' times
    assert rank_memory_line(base, same) == ("peak device memory per rank, measured: rank 0 0.5 KiB (baseline 1.0 KiB), "
                                            "rank 1 1.0 KiB (baseline 2.0 KiB)")

    # rank 1 off by 1e-3: rank 0 alone (what a rank-0-only check sees) would pass
    off = _steps([(2.0, 3.003)] * 6, [(0.010, 0.020)] * 6)
    check, _ = Comparison(base, off, Plan(), TuneOptions(), losses=aligned_losses(known, off)).numerics()
    assert not check.passed and check.reason.startswith("rank 1 (of 2, each against the baseline's same rank)")


def test_another_sharding_of_cpu_ranks_is_measured_but_never_claimed():
    sharding = Plan(actions=[Mesh(axes={"data": 2})])
    assert resharded_on_cpu_ranks(sharding, TuneOptions(nproc=2))
    assert not resharded_on_cpu_ranks(sharding, TuneOptions())  # one process: the simulated-devices rule instead
    assert not resharded_on_cpu_ranks(Plan(actions=[PadOps(multiple=8)]), TuneOptions(nproc=2))
    # a mesh in one process: over simulated CPU devices, its time never claimed either; without one, no mesh to judge
    assert simulated_devices_only(sharding) and not simulated_devices_only(Plan(actions=[PadOps(multiple=8)]))


@pytest.mark.slow  # two 2-rank jobs
@pytest.mark.matrix  # the default pass: every trial of the 2-rank tune below is such a trial process (its steps each
# rank's, its memory per rank measured, a parallelism action alone included), a ranked step is its slowest rank's
# (the first test of this file), and FSDP2's reshard_after_forward=False raises each rank's in-step peak
# (tests/profile/test_step_peak.py)
def test_a_trial_process_steps_every_rank_together_and_its_memory_per_rank_is_its_in_step_peak(tmp_path):
    """A trial process at 2 ranks: each step is every rank's record, timed as the slowest rank's, each rank's loss
    its own data's; stopped at a step boundary, every rank leaves its process group and the launcher exits 0.
    What the tuner's parallelism changes do to memory per rank, measured: examples/fsdp2.py's ranks report their
    in-step peak (backend/core/memory.py's StepPeak), which FSDP2's reshard_after_forward=False raises (the gathered
    parameters held from forward to backward), though the bytes alive at a step boundary are the same (measured by
    hand, 2026-12-05: 1,652,856 B as written, 1,769,848 kept, 1,513,256 with every block checkpointed, which
    tests/profile/test_step_peak.py checks; 1,113,908 at the boundary for all three)."""
    script = Path(__file__).resolve().parents[2] / "examples" / "fsdp2.py"  # rank r's batch at step s: seed (r, s)
    peaks = {}
    for name, plan in (("as written", Plan()), ("kept", Plan(actions=[FsdpReshard(reshard=False)]))):
        proc = TrialProcess(script, ["--steps", "4"], plan, cwd=tmp_path, log_dir=tmp_path / "logs",
                            step_timeout=120, env={}, name=name.replace(" ", "-"), nproc=2)
        with proc:
            steps = [proc.step() for _ in range(3)]
        for record in steps:
            ranks = rank_records(record)
            assert len(ranks) == 2
            assert record.wall_s == max(r.wall_s for r in ranks)  # the slowest rank's time
            assert record.loss == ranks[0].loss and ranks[0].loss != ranks[1].loss  # each rank's own data
            assert all(r.device_bytes > 0 for r in ranks)
        # stopped at a step boundary (step 3 of 4): every rank left its process group, the launcher with them (the
        # log says why not)
        log = tmp_path / "logs" / f"{name.replace(' ', '-')}.log"
        assert proc.proc.returncode == 0, log.read_text(errors="replace")[-3000:]
        # the most over the steps: when Python's collector frees FSDP2's cyclic garbage moves a step's peak (by up
        # to 66 KB seen on "kept": 1,703,164 and 1,769,848 B at step 3 of two runs)
        peaks[name] = [max(r.device_bytes for r in ranks) for ranks in zip(*(rank_records(s) for s in steps))]
    for rank in (0, 1):
        assert peaks["kept"][rank] > peaks["as written"][rank], peaks


def test_a_rank_that_crashes_fails_the_trial_with_its_own_line(tmp_path):
    script = tmp_path / "ddp.py"
    script.write_text(DDP)
    env = {"STEPS": "6"}
    counter = tmp_path / "counter"
    counter.write_text("job\njob\n")  # the third job: rank 1 raises at step 3
    crashing = TrialProcess(script, [], Plan(), cwd=tmp_path, log_dir=tmp_path / "logs", step_timeout=120,
                            env={**env, "RANKS_COUNTER": str(counter)}, name="crash", nproc=2)
    with pytest.raises(TrialFailed) as failed:
        with crashing:
            for _ in range(5):
                crashing.step()
    assert failed.value.kind == "crashed"
    assert failed.value.message.splitlines()[0] == "rank 1: RuntimeError: boom on rank 1"
    assert crashing.proc.returncode not in (None, 0) and len(crashing.steps) == 3  # steps 1-3, then the raise


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    script = tmp_path / "ddp.py"
    script.write_text(DDP)
    zero = run_tool("tune", "--nproc", "0", str(script), cwd=tmp_path)
    assert zero.returncode == 2 and "--nproc" in zero.stderr, zero.stderr
    both = run_tool("tune", "--nproc", "2", "--devices", "2", str(script), "--offline", cwd=tmp_path)
    assert both.returncode == 2
    assert one_error_line(both) == ("error: --devices simulates devices in one process; with --nproc each rank is "
                                    "one process with one device: give one or the other")
    assert not (tmp_path / ".tpu-agent" / "runs").exists() or not any((tmp_path / ".tpu-agent" / "runs").iterdir())


def _tune(tmp_path: Path, *extra: str, env: dict[str, str] | None = None):
    script = tmp_path / "ddp.py"
    script.write_text(DDP)
    # --processes 1: one fresh baseline/candidate job pair verifies (what is checked is that every rank is, not the
    # interval's spread over job pairs, which tests/verify and tests/measure check). --warmup 2: DDP's second step
    # compiles programs its first did not; with one warm-up step the profile reads the script as recompiling, and
    # each measurement starts a fresh baseline job
    proc = run_tool("tune", "--nproc", "2", str(script), "--offline", "--steps", "5", "--warmup", "2",
                    "--pairs", "5", "--processes", "1", *extra, cwd=tmp_path, env=clean_env(**(env or {})),
                    timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = next((tmp_path / ".tpu-agent" / "runs").iterdir())
    return proc, json.loads((run_dir / "report.json").read_text()), run_dir


def test_a_verification_at_2_ranks_checks_each_rank_and_measures_its_memory(tmp_path):
    """verify() as the tune calls it, on fresh 2-rank jobs: accepted or rejected on speed (noise decides on a
    shared host), its numerics every rank's against the same rank's, its memory every rank's."""
    script = tmp_path / "ddp.py"
    script.write_text(DDP)
    # one fresh job pair (processes=1) of 5 interleaved pairs: every rank checked, 5 ratios for the interval
    options = TuneOptions(nproc=2, steps=5, warmup=1, pairs=5, processes=1, trial_timeout=120)
    runner = Runner(script, [], options, tmp_path / "run")
    plan = Plan(actions=[PadOps(multiple=8)])  # exact: Linear(24, 4)'s 4 outputs padded to 8
    verdict = verify(plan, Measuring(runner, options))
    assert verdict.numerics is not None and verdict.numerics.kind == "exact", verdict.reason
    assert verdict.numerics.passed, verdict.numerics.reason
    assert verdict.numerics.reason.startswith("each of the 2 ranks against the baseline's same rank")
    assert verdict.numerics.steps == options.warmup + options.steps  # every step of one round, rank by rank
    assert "2 ranks, each step timed as its slowest rank's" in verdict.reason
    assert len(verdict.rank_memory) == 2 and all(before > 0 and after > 0 for before, after in verdict.rank_memory)
    assert verdict.speed is not None and len(verdict.speed.ratios) >= 3  # pairs of slowest-rank step times


@pytest.mark.slow
def test_tune_nproc_2_reports_every_rank(tmp_path):
    """A 2-rank tune end to end: the baseline's every rank, a trial's numerics and memory per rank, and the
    parallelism step's plans alone, each rank's memory. --verify 0: whether the tune verifies at all depends on the
    trial measuring faster (1.13x in one run, 0.89x in the next, on a shared host), and a verification's fresh
    2-rank jobs took about 74 s of a 255 s tune under load (its phase with the parallelism step: 152 s, 78 s without);
    verify() at 2 ranks, every rank checked and its memory measured, is
    test_a_verification_at_2_ranks_checks_each_rank_and_measures_its_memory, on every run."""
    proc, report, run_dir = _tune(tmp_path, "--trials", "1", "--verify", "0")
    assert "2 ranks (torch.distributed.run): a step takes its slowest rank's time" in proc.stdout
    assert "rank 0: median step" in proc.stdout and "rank 1: median step" in proc.stdout
    profile = json.loads(Path(report["baseline_profile"]).read_text())
    assert profile["distributed"]["world_size"] == 2 and len(profile["distributed"]["ranks"]) == 2
    trial = report["trials"][0]
    assert trial["state"] in ("complete", "numerics"), trial
    study = optuna.load_study(study_name=report["study"], storage=f"sqlite:///{tmp_path / '.tpu-agent' / 'studies.db'}")
    numerics = study.trials[0].user_attrs["numerics"]
    assert numerics.startswith(("each of the 2 ranks against", "rank ")), numerics
    if trial["state"] == "complete":
        assert len(trial["rank_memory"]) == 2 and all(a > 0 and b > 0 for a, b in trial["rank_memory"])
    assert report["verdicts"] == [] and report["best"] is None  # --verify 0: search only
    # The trial's plan is the offline proposer's seed, every candidate's first option together, activation
    # checkpointing among them: the parallelism step measures it alone against the baseline, each rank's memory.
    parallelism = report["parallelism"]
    assert parallelism["world_size"] == 2, parallelism
    alone = [row for row in parallelism["plans"] if row["state"] == "alone"]
    assert alone and all(len(row["rank_memory"]) == 2 and all(a > 0 and b > 0 for a, b in row["rank_memory"])
                         for row in alone), parallelism
    # ... against the search's warm baseline (--verify 0): no second 2-rank baseline job
    assert profile["recompiling"] is None, profile["recompiling"]
    assert sorted(p.name for p in (run_dir / "logs").glob("baseline-*.log")) == ["baseline-1.log"]


@pytest.mark.slow
@pytest.mark.matrix  # the default pass: a rank's crash fails its TrialProcess with that rank's line (above), and a
# crashed candidate is a failed trial with its reason (tests/search/test_tune.py's failing trials)
def test_a_rank_that_crashes_in_a_trial_is_a_failed_trial(tmp_path):
    counter = tmp_path / "counter"
    proc, report, _ = _tune(tmp_path, "--trials", "1", "--verify", "1", env={"RANKS_COUNTER": str(counter)})
    trial = report["trials"][0]
    assert trial["state"] == "failed", trial
    assert trial["reason"] == "crashed: rank 1: RuntimeError: boom on rank 1"
    assert report["best"] is None and "no change verified" in proc.stdout
