"""`tune --target SLICE --slices N`'s ranking: one trace stands for every data x fsdp split of its chips (re-costed,
projection/remesh.py), the data axis spans the slices over DCN, and the plans rank as `project` run on each alone
ranks them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tpu_agent import slices
from tpu_agent.projection import rank, remesh
from tpu_agent.run.projection import project, projector

TINY = str(Path(__file__).with_name("tiny_llama.py"))
ARGS = ["--steps", "3", "--optimizer", "sgd"]


@pytest.fixture(scope="module")
def ranked():
    """The tiny Llama on 2 slices of v5e-4 (8 chips), 2 sequences per chip, one trace spent."""
    sl = slices.read("2xv5e-4")
    said = []
    return rank.rank(sl, projector(TINY, ARGS, sl, 16), None, script_batch=16, budget=1, say=said.append), said


@pytest.fixture(scope="module")
def alone(ranked):
    """`project` run alone on each re-costed plan (its own trace on its own mesh). The traced plan's projection is
    `project`'s own: the same partition and cost calls on the same mesh."""
    r, _ = ranked
    sl = slices.read("2xv5e-4")
    return {tuple(sorted(p.plan.mesh.items())): project(TINY, ARGS, sl, p.plan.mesh, per_chip_batch=p.plan.per_chip_batch)[1]
            for p in r.ranked if p.recosted_from is not None}


def _key(p):
    return tuple(sorted(p.plan.mesh.items()))


def test_one_trace_ranks_every_data_split_over_dcn_and_a_re_costed_plan_reads_as_project_alone(ranked, alone):
    """One ranking (one trace) and `project` alone on each re-costed plan, checked together (each is a set of
    traces: the suite's time). The ranking: the data axis spans both slices over DCN, its other data x fsdp splits
    are re-costed from the one trace, memory per chip grows with the data ways. A re-costed plan reads as `project`
    alone on its mesh in memory per chip and DCN time, and pure data parallelism in step time too."""
    r, said = ranked
    assert r.slices == 2 and r.chips == 8 and r.slice == "2xv5e-4" and r.traces == 1
    assert r.estimate is True and r.verified is False and r.label == "projected for 2xv5e-4"
    meshes = [p.plan.mesh for p in r.ranked]
    assert sorted(m.get("data", 1) for m in meshes) == [2, 4, 8]  # the data axis always spans both slices
    assert all(p.error is None and p.dcn_s > 0 for p in r.ranked)  # the gradients all-reduced across slices
    assert all(any("2 slices" in a and "DCN" in a for a in p.assumptions) for p in r.ranked)
    recosted = [p for p in r.ranked if p.recosted_from is not None]
    assert len(recosted) == 2 and all(p.recosted_from == {"fsdp": 4} for p in recosted)
    assert any("2 other data x fsdp splits re-costed from that trace" in line for line in said)
    assert any("budget of 1 traces" in n for n in r.notes)
    # replicated over more data ways, the parameters and optimizer state take more memory per chip
    by_data = {p.plan.mesh.get("data"): p for p in r.ranked}
    assert by_data[2].memory_per_chip_bytes < by_data[4].memory_per_chip_bytes < by_data[8].memory_per_chip_bytes

    # each re-costed plan against `project` alone on its mesh
    assert len(alone) == 2
    for p in recosted:
        a = alone[_key(p)]
        assert p.memory_per_chip_bytes == pytest.approx(a.hbm_bytes_per_chip, rel=0.1), p.plan.mesh
        assert p.dcn_s == pytest.approx(a.dcn_s, rel=0.01) and p.dcn_s > 0
    data = next(p for p in recosted if p.plan.mesh == {"data": 8})  # pure data parallel: the same per-chip work
    assert data.step_s == pytest.approx(alone[_key(data)].step_s, rel=0.02)


@pytest.mark.slow
@pytest.mark.matrix  # an expected failure (strict: it passes once the re-costing reads XLA's layout): its own ranking
# and projections, 18 s, for no check the default pass needs; the default pass checks the re-costed plans' memory,
# DCN and pure-data step time against `project` alone (above)
@pytest.mark.xfail(strict=True, reason="XLA:CPU partitions the tiny Llama on data=4,fsdp=2 otherwise: "
                   "its fsdp-split weights re-laid and gathered over data and fsdp (40 collective-permutes, 37 "
                   "all-gathers over the slice's 4 chips) and 25% more dot FLOPs, where the re-costing assumes the "
                   "HSDP layout: 0.39 ms alone against 0.20 ms re-costed (projection/remesh.py)")
def test_the_ranking_orders_the_plans_as_project_alone_does(ranked, alone):
    r, _ = ranked
    step = {_key(p): alone[_key(p)].step_s if p.recosted_from is not None else p.step_s for p in r.ranked}
    order = [_key(p) for p in r.ranked]
    assert order == sorted(order, key=step.get)


def test_only_a_data_axis_carved_out_of_fsdp_is_re_costed():
    assert remesh.data_split({"fsdp": 8}, {"data": 2, "fsdp": 4}) == 2
    assert remesh.data_split({"fsdp": 4, "tensor": 2}, {"data": 4, "tensor": 2}) == 4
    assert remesh.data_split({"fsdp": 8}, {"data": 2, "fsdp": 2, "tensor": 2}) is None  # another tensor split
    assert remesh.data_split({"fsdp": 8}, {"data": 3, "fsdp": 2}) is None


def test_tune_takes_several_slices_of_a_slice_target(capsys):
    from tpu_agent.cli.app import run_cli
    from tpu_agent.config import TuneOptions

    options = TuneOptions(target="tpu7x-4x8x8", slices=32)
    assert options.slice == "32xtpu7x-4x8x8" and TuneOptions(target="v6e-256").slice == "v6e-256"
    sl = slices.read(options.slice)  # what the ranking reads (parallelism/target.py)
    assert (sl.slices, sl.chips, sl.total_chips, sl.name) == (32, 256, 8192, "32xv7x-512")
    assert "32 such slices joined by DCN: 8192 chips" in sl.read_as
    assert run_cli(["tune", TINY, "--slices", "2"]) == 2  # the default target, this machine, has no slices
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "several slices need a slice --target" in err, err
