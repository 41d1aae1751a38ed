"""`tune --target SLICE`: plans ranked by projected step time per sample among those that fit per chip; labelled
estimates, never verified; a slice the generation does not offer is one line and exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from tpu_agent import slices
from tpu_agent.cli.app import run_cli
from tpu_agent.parallelism import target
from tpu_agent.projection import rank
from tpu_agent.projection.placement import data_parallel
from tpu_agent.projection.rank import ProjectedPlan, SlicePlan
from tpu_agent.report.projection import console_line, section
from tpu_agent.run.projection import projector

TINY = str(Path(__file__).with_name("tiny_llama.py"))


def _table_projector(table):
    """Projections read from `table` (mesh, per-chip batch, checkpoint) -> (step s, memory bytes): the search and
    the ranking on known figures. Plans not in the table are slow and fit."""
    asked = []

    def project(plan: SlicePlan):
        asked.append(plan)
        step, memory = table.get((tuple(sorted(plan.mesh.items())), plan.per_chip_batch, plan.checkpoint), (1.0, 1e9))
        batch = (plan.per_chip_batch or 2) * data_parallel(plan.mesh)
        return ProjectedPlan(plan=plan, global_batch=batch, step_s=step, time_per_sample_s=step / batch, mfu=0.1,
                             memory_per_chip_bytes=memory, hbm_bytes=32 * 2**30, fits=memory <= 32 * 2**30), 4

    return project, asked


def test_the_fastest_plan_that_fits_is_chosen_and_one_that_does_not_fit_never_is():
    sl = slices.parse("v6e-4")
    fsdp, tp = (("fsdp", 4),), (("fsdp", 2), ("tensor", 2))
    table = {
        (fsdp, None, False): (0.010, 20e9),  # the script as written (its batch: 8, 2 per chip)
        (fsdp, 2, True): (0.011, 8e9),
        (fsdp, 4, False): (0.012, 60e9),  # per sample the fastest of all, but 60 GB per chip: does not fit
        (fsdp, 4, True): (0.016, 15e9),  # the fastest per sample of those that fit: 1 ms
        (tp, 2, False): (0.006, 20e9),  # 2 per chip on an fsdp axis of 2: a global batch of 4, 1.5 ms per sample
    }
    project, asked = _table_projector(table)
    kept = []
    ranking = rank.rank(sl, project, tensor_dims=[64, 128], script_batch=8, budget=10, keep=kept.append)
    assert len(asked) == ranking.projections <= 10
    assert [r.projections for r in kept[:-1]] == list(range(2, 11)) and kept[-1] == ranking  # kept as it goes
    assert ranking.after.plan == SlicePlan(mesh={"fsdp": 4}, per_chip_batch=4, checkpoint=True)
    costs = [p.time_per_sample_s for p in ranking.ranked if p.fits]
    assert costs == sorted(costs) and ranking.ranked[0] == ranking.after
    unfit = next(p for p in ranking.ranked if not p.fits)
    assert unfit.time_per_sample_s < ranking.after.time_per_sample_s  # faster, and not chosen
    assert ranking.verified is False and ranking.label == "projected for v6e-4"
    assert ranking.before.plan.per_chip_batch is None and ranking.before.step_s == 0.010


def test_the_budget_bounds_the_projections_and_none_fitting_chooses_none():
    sl = slices.parse("v6e-16")
    project, asked = _table_projector({})
    huge = lambda plan: (project(plan)[0].model_copy(update={"fits": False}), 4)  # noqa: E731
    ranking = rank.rank(sl, huge, tensor_dims=[64], script_batch=None, budget=3)
    assert ranking.projections == 3 == len(asked)
    assert ranking.after is None and "no plan projected fits in HBM per chip (projected for v6e-16)" in ranking.notes
    assert ranking.meshes == len(rank.meshes(16, [64])) == 15  # data x fsdp x tensor = 16, every order of 2s
    assert ranking.candidates == 15 * 7 * 2
    assert any("stopped at its budget of 3" in n for n in ranking.notes)


def test_a_round_the_budget_cuts_short_is_said():
    """The best plan so far is the start, and the budget ends among its neighbours: the search says so."""
    project, asked = _table_projector({((("fsdp", 4),), None, False): (0.001, 1e9)})
    ranking = rank.rank(slices.parse("v6e-4"), project, tensor_dims=[64], script_batch=8, budget=3)
    assert ranking.projections == 3 == len(asked) and ranking.after.plan.per_chip_batch == 2
    assert any("left unprojected" in n for n in ranking.notes), ranking.notes


def test_a_script_whose_batch_cannot_change_is_ranked_at_its_own_batch():
    project, asked = _table_projector({})

    def fixed_batch(plan):
        if plan.per_chip_batch is not None:
            return ProjectedPlan(plan=plan, error="--per-chip-batch 1: the script's batch cannot be changed (...)"), 4
        return project(plan)

    ranking = rank.rank(slices.parse("v6e-4"), fixed_batch, tensor_dims=[64], script_batch=None, budget=10)
    assert {p.plan.per_chip_batch for p in ranking.ranked} == {None} and len(ranking.ranked) >= 3
    assert ranking.after is not None and any("batch cannot be changed" in n for n in ranking.notes)
    assert ranking.candidates == ranking.meshes * 2  # no batches: meshes x checkpointing


def test_meshes_are_every_factorisation_the_dims_allow():
    assert rank.meshes(8, None) == [{"fsdp": 8}, {"data": 2, "fsdp": 4}, {"data": 4, "fsdp": 2}, {"data": 8}]
    tensor = {m.get("tensor", 1) for m in rank.meshes(8, [64, 32, 128])}
    assert tensor == {1, 2, 4, 8}
    assert {m.get("tensor", 1) for m in rank.meshes(8, [96, 12])} == {1, 2, 4}  # gcd 12: no 8


@pytest.fixture(scope="module")
def projected():
    """Two real projections of the tiny Llama on v6e-4: the script as written (8 x 32 tokens: 2 per chip), and
    the same plan with its blocks checkpointed."""
    sl = slices.parse("v6e-4")
    args = ["--steps", "4", "--optimizer", "sgd"]
    return rank.rank(sl, projector(TINY, args, sl, 8), tensor_dims=[64, 32, 128], script_batch=8, budget=2)


def test_a_real_ranking_is_labelled_and_checkpointing_saves_memory(projected):
    r = projected
    assert r.traces == 2 and r.projections == len(r.ranked) == 2 * 3  # each trace's 3 data x fsdp splits
    assert sum(p.recosted_from is not None for p in r.ranked) == 4
    plain = next(p for p in r.ranked if not p.plan.checkpoint and p.recosted_from is None)
    checkpointed = next(p for p in r.ranked if p.plan.checkpoint and p.recosted_from is None)
    assert plain.plan == SlicePlan(mesh={"fsdp": 4}, per_chip_batch=2) and plain.step_s == r.before.step_s
    assert checkpointed.error is None and checkpointed.fits and plain.fits
    assert checkpointed.memory_per_chip_bytes < plain.memory_per_chip_bytes  # what backward reads is recomputed
    assert r.after == min(r.ranked, key=lambda p: p.time_per_sample_s)
    text = "\n".join(section(r))
    for row in ("| MFU (projected for v6e-4) |", "| memory per chip (projected for v6e-4) |",
                "| step time (projected for v6e-4) |"):
        assert row in text
    assert "not verified" in text and "accepted" not in text and "6 of " in text
    assert "(not verified)" in console_line(r) and "projected for v6e-4" in console_line(r)


def test_a_slice_the_generation_does_not_offer_is_one_line_and_exit_2(capsys):
    assert run_cli(["tune", TINY, "--target", "v6e-7"]) == 2
    err = capsys.readouterr().err
    assert err == "error: --target: v6e offers slices of 1, 4, 8, 16, 32, 64, 128, 256 chips, not 7 (got 'v6e-7')\n"


def test_a_slice_from_pyproject_is_checked_the_same(tmp_path, capsys):
    (tmp_path / "pyproject.toml").write_text('[tool.tpu-agent]\ntarget = "v5p-100"\n')
    script = tmp_path / "train.py"
    script.write_text(Path(TINY).read_text())
    assert run_cli(["tune", str(script)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "[tool.tpu-agent] target: v5p offers no slice of 50 chips" in err, err
    assert "(got 'v5p-100')" in err


def test_a_tune_for_a_slice_writes_the_ranking_beside_what_it_measured(tmp_path, monkeypatch):
    """The pipeline in process (every process faked, support.fake_tune) with --target v6e-4: the projection phase
    runs after the baseline, report.md and report.json carry it, and the verdicts stay the measured ones."""
    import json
    from functools import partial

    from support import fake_tune
    from tpu_agent.config import TuneOptions

    (tmp_path / "train.py").write_text("import torch\n")
    monkeypatch.setattr(fake_tune, "TuneOptions", partial(TuneOptions, target="v6e-4"))
    project, asked = _table_projector({})
    monkeypatch.setattr(target, "projector", lambda *args, **kwargs: project)
    result, _, text = fake_tune.tune(tmp_path, monkeypatch, fake_tune.Padding(), trials=3)
    assert result.projection is not None and result.projection.projections == len(asked) == 10
    assert list(result.phase_s)[:2] == ["baseline", "projection"]
    assert "projection (projected for v6e-4): the script as written" in text
    report = (Path(result.run_dir) / "report.md").read_text()
    assert "### Plans for v6e-4 ranked by projection (projected for v6e-4; estimates, not verified)" in report
    saved = json.loads((Path(result.run_dir) / "report.json").read_text())
    assert saved["projection"]["verified"] is False and saved["settings"]["target"] == "v6e-4"
    assert all(v.plan.mesh is None for v in result.verdicts)  # a projected plan is never a verdict's
