"""`tune --nproc N --target SLICE`: the parallelism plans the search measured keep their measured memory per rank and
their time on this host (labelled this host's), and are ranked for the slice by projection (labelled estimates),
never by the time measured here; no line calls a projected figure verified (issue #26 point 6)."""

from __future__ import annotations

from tpu_agent.plan.actions import ActivationCheckpointing, FsdpParamDtype, FsdpReshard, MeshShape, PadOps, Plan
from tpu_agent import slices
from tpu_agent.parallelism import target
from tpu_agent.parallelism.measured import measured_plans, point_for, rank_for_slice
from tpu_agent.projection import rank
from tpu_agent.projection.rank import ProjectedPlan, SlicePlan
from tpu_agent.report import parallelism
from tpu_agent.search.records import TrialRecord, TrialState

TP2 = Plan(actions=[MeshShape(shape=(1, 2), dp_batches=False)])
DP2 = Plan(actions=[MeshShape(shape=(2, 1), dp_batches=False)])
CKPT = Plan(actions=[ActivationCheckpointing(every=1)])
KEEP = Plan(actions=[FsdpReshard(reshard=False)])


def test_a_plan_keeps_its_tensor_degree_on_the_slice_and_fsdp_spans_the_other_chips():
    assert point_for(TP2, 8) == (SlicePlan(mesh={"fsdp": 4, "tensor": 2}, per_chip_batch=None), None)
    assert point_for(DP2, 8)[0].mesh == {"fsdp": 8}
    assert point_for(TP2, 8, slices=2)[0].mesh == {"data": 2, "fsdp": 4, "tensor": 2}  # data across the slices
    ckpt, note = point_for(CKPT, 8)
    assert (ckpt.mesh, ckpt.checkpoint, note) == ({"fsdp": 8}, True, None)
    keep, note = point_for(KEEP, 8)  # not in the projection's model: the script's own plan, said so
    assert (keep.mesh, keep.checkpoint) == ({"fsdp": 8}, False)
    assert "not in the projection's model" in note and "reshard_after_forward=False" in note
    odd, note = point_for(Plan(actions=[MeshShape(shape=(1, 4), dp_batches=False)]), 6)
    assert odd.mesh == {"fsdp": 6} and "does not divide" in note
    bf16 = point_for(Plan(actions=[FsdpParamDtype(param_dtype="bfloat16")]), 4)[1]
    assert "not in the projection's model" in bf16
    half, note = point_for(Plan(actions=[ActivationCheckpointing(every=2), PadOps(multiple=8)]), 8)
    assert half.checkpoint and "one block in 2: projected as every block" in note
    assert "not projected: pad_ops" in note


def _trial(number, plan, speedup, memory, state=TrialState.COMPLETE):
    return TrialRecord(number=number, plan=plan, state=state, speedup=speedup, rank_memory=memory)


TRIALS = [
    _trial(0, TP2, 1.40, [(1000, 900), (1000, 900)]),  # the fastest here
    _trial(1, CKPT, 0.90, [(1000, 800), (1000, 800)]),
    _trial(2, KEEP, 1.10, [(1000, 1100), (1000, 1100)]),
    _trial(3, Plan(actions=[PadOps(multiple=8)]), 1.30, [(1000, 1000), (1000, 1000)]),  # not a parallelism plan
    _trial(4, DP2, None, None, state=TrialState.FAILED),  # nothing measured
]


def _projector():
    """Projected step times the other way round from this host's: tensor parallel is the slowest on the slice."""
    steps = {(("fsdp", 8),): 0.010, (("fsdp", 4), ("tensor", 2)): 0.030}
    asked = []

    def project(plan: SlicePlan):
        asked.append(plan)
        step = steps.get(tuple(sorted(plan.mesh.items())), 0.050) * (1.2 if plan.checkpoint else 1.0)
        return ProjectedPlan(plan=plan, global_batch=16, step_s=step, time_per_sample_s=step / 16, mfu=0.3,
                             memory_per_chip_bytes=2**30, hbm_bytes=16 * 2**30, fits=True), 3

    return project, asked


def test_measured_parallelism_plans_are_ranked_by_projection_not_by_their_time_here():
    measured = measured_plans(TRIALS, 2, "this host (cpu, 2 processes)")
    assert [r.trial for r in measured.plans] == [0, 1, 2]  # parallelism plans that measured something
    project, asked = _projector()
    sl = slices.parse("v5e-8")
    ranking = rank.rank(sl, project, tensor_dims=[64], budget=1)  # the script as written, fsdp 8
    asked.clear()
    ranked = rank_for_slice(measured, ranking, project)
    # the as-written projection reused for the reshard plan; the tp and checkpointed plans projected
    assert sorted(tuple(sorted(p.mesh.items())) + (p.checkpoint,) for p in asked) == [
        (("fsdp", 4), ("tensor", 2), False), (("fsdp", 8), True)]
    assert [r.trial for r in ranked.plans] == [2, 1, 0]  # 10 ms, 12 ms, 30 ms projected: not 1.40x, 1.10x, 0.90x
    assert ranked.slice == "v5e-8" and ranked.label == "projected for v5e-8" and not ranked.verified
    assert ranked.plans[2].rank_memory == [(1000, 900), (1000, 900)]  # the measured figures travel with it

    lines = parallelism.console_lines(ranked)
    assert "times are this host's (measured), not a TPU slice's" in lines[0]
    assert "ranked for v5e-8 by projection (projected for v5e-8, estimates, not verified)" in lines[0]
    assert lines[1].startswith("  1. trial 2 (exact): FSDP2 reshard_after_forward=False: memory per rank, "
                               "measured: rank 0 1.1 KiB (+10.0%), rank 1 1.1 KiB (+10.0%); speed here 1.100x (measured, "
                               "this host); projected for v5e-8: step 10 ms")
    text = "\n".join(parallelism.section(ranked))
    assert "never claimed for a TPU" in text and "estimates, not verified" in text
    assert "verified TPU" not in text and "speedup on v5e" not in text


def test_without_a_target_the_plans_say_their_memory_per_rank_in_trial_order():
    measured = measured_plans(TRIALS, 2, "this host (cpu, 2 processes)")
    lines = parallelism.console_lines(measured)
    assert "ranked for" not in lines[0] and "in-step peak (measured)" in lines[0]
    assert "activation checkpointing of every block: memory per rank, measured: rank 0 0.8 KiB (-20.0%)" in lines[2]
    text = "\n".join(parallelism.section(measured))
    assert "projected" not in text.split("| # |")[1]  # no projection columns
    assert measured_plans(TRIALS[3:], 2, "here") is None


def test_a_tune_at_2_ranks_for_a_slice_ranks_its_measured_parallelism_plans(tmp_path, monkeypatch):
    """The pipeline in process (support.fake_tune; every process faked) at --nproc 2 --target v5e-8: the trials'
    per-rank memory reaches the parallelism section, which is ranked by the (faked) projection, and the verdicts
    stay the measured ones."""
    import json
    from functools import partial
    from pathlib import Path

    from support import fake_tune
    from support.fake_runner import FakeRunner
    from tpu_agent.config import TuneOptions
    from tpu_agent.measure.trials import RankedStep
    from tpu_agent.propose.base import ProposalRound, Proposer
    from tpu_agent.propose.candidates import ActionTemplate, Candidate

    class Parallelism(Proposer):
        name = "offline"

        def propose(self, profile, knobs=(), playbooks=None, results=(), round=1):
            return ProposalRound(proposer="offline", requested="offline", candidates=[
                Candidate(id="ckpt", title="checkpointing", proposer="offline", rank=1, preserves_numerics=True,
                          actions=[ActionTemplate(kind="activation_checkpointing", choices={"every": [1, 2]})])])

    class TwoRanks(FakeRunner):
        """Each step of two ranks; checkpointing every block lowers both ranks' bytes by a fifth."""

        def measure(self, plan, name, pairs, report=None, fresh_baseline=False):
            a, b, cand = super().measure(plan, name, pairs, report, fresh_baseline)
            every = plan.of(ActivationCheckpointing)
            after = 800 if every and every[0].every == 1 else 900 if every else 1000

            def ranked(steps, size):
                return [RankedStep.of([s.model_copy(update={"device_bytes": size}) for _ in range(2)]) for s in steps]
            return ranked(a, 1000), ranked(b, after), cand

    (tmp_path / "train.py").write_text("import torch\n")
    monkeypatch.setattr(fake_tune, "TuneOptions", partial(TuneOptions, target="v5e-8", nproc=2))
    monkeypatch.setattr(fake_tune, "FakeRunner", TwoRanks)
    project, asked = _projector()
    monkeypatch.setattr(target, "projector", lambda *args, **kwargs: project)
    result, _, text = fake_tune.tune(tmp_path, monkeypatch, Parallelism(), trials=2)
    measured = result.parallelism
    assert measured is not None and measured.slice == "v5e-8" and not measured.verified
    trials = [r for r in measured.plans if r.trial is not None]
    alone = {r.plan.describe(): r for r in measured.plans if r.trial is None}
    assert {r.plan.describe() for r in trials} == set(alone) == {"activation checkpointing of every block",
                                                                 "activation checkpointing of one block in 2"}
    assert alone["activation checkpointing of one block in 2"].rank_memory == [(1000, 900), (1000, 900)]
    assert "activation checkpointing of every block alone: memory per rank, measured: rank 0 0.8 KiB (-20.0%)" in text
    assert all(r.projected is not None and r.projected.plan.checkpoint for r in measured.plans)
    every = next(r for r in trials if "every block" in r.plan.describe())
    assert every.rank_memory == [(1000, 800), (1000, 800)]
    assert "memory per rank, measured: rank 0 0.8 KiB (-20.0%), rank 1 0.8 KiB (-20.0%)" in text
    report = (Path(result.run_dir) / "report.md").read_text()
    assert "### Parallelism changes: memory per rank and time measured here, ranked for v5e-8 by projection" in report
    assert json.loads((Path(result.run_dir) / "report.json").read_text())["parallelism"]["verified"] is False
    assert result.best is not None  # checkpointing, faster here (the fake runner's "execution" factor)
    assert "*Not a TPU speedup:* measured on this host" in report and "for v5e-8 the parallelism changes" in report
    assert "| device memory per rank (in-step peak, measured) | rank 0 1000 B" not in report  # KiB, as the lines
    assert "| device memory per rank (in-step peak, measured) | rank 0 1.0 KiB, rank 1 1.0 KiB | rank 0 " in report


def test_each_parallelism_action_is_measured_alone_once():
    from tpu_agent.parallelism.alone import actions_tried

    plans = [Plan(actions=[PadOps(multiple=8), FsdpReshard(reshard=True), ActivationCheckpointing(every=1)]),
             Plan(actions=[ActivationCheckpointing(every=2)]), Plan(actions=[FsdpReshard(reshard=False)]), TP2,
             Plan(actions=[FsdpReshard(reshard=False)])]
    assert [p.describe() for p in actions_tried(plans)] == [  # one of each kind first; reshard False before True
        "FSDP2 reshard_after_forward=False", "activation checkpointing of every block", TP2.describe(),
        "FSDP2 reshard_after_forward=True", "activation checkpointing of one block in 2"]
