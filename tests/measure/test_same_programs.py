"""A change whose step runs the baseline's programs is "no change", told by the programs themselves (run/programs.py)
when the profile could not tell it (measure/noop.py): never timed by a trial, never verified, dropped by the
ablation. On real processes: a padding to a multiple every dim already has is caught after its warm-up, one
that pads is measured."""

from __future__ import annotations

import textwrap

import pytest
import torch
from rich.console import Console

from tpu_agent.config import TuneOptions
from tpu_agent.measure.context import Measuring
from tpu_agent.measure.runner import Runner
from tpu_agent.measure.trials import TrialFailed
from tpu_agent.plan.actions import Compile, PadBatch, PadOps, Plan
from tpu_agent.verify.ablation import why_dropped
from tpu_agent.verify.verdict import Attribution, verify

FIXED = textwrap.dedent("""\
    import torch
    import torch.nn.functional as F
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10)).to("tpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 64).to("tpu"), torch.randint(0, 10, (16,)).to("tpu")
    for _ in range(40):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
""")


def test_the_programs_of_a_step_fingerprint_what_runs_and_how_often():
    from tpu_agent.run.programs import calls, fingerprint

    a = torch.randn(8, 16, device="tpu")
    b = torch.randn(16, 4, device="tpu")
    (a @ b).relu()
    before = calls()
    (a @ b).relu()
    once = fingerprint(before)
    before = calls()
    (a @ b).relu()
    assert fingerprint(before) == once  # the same ops again
    before = calls()
    (a @ b).relu()
    (a @ b).relu()
    twice = fingerprint(before)
    assert twice != once and twice.split(":")[0] == once.split(":")[0]  # the same programs, twice as often
    before = calls()
    (a @ torch.randn(16, 8, device="tpu")).relu()
    assert fingerprint(before) != once  # another shape: another program


@pytest.mark.slow  # three processes of a tiny script
def test_a_padding_that_pads_nothing_is_no_change_and_one_that_pads_is_measured(tmp_path):
    script = tmp_path / "fixed.py"
    script.write_text(FIXED)
    runner = Runner(script, [], TuneOptions(), tmp_path / "run")
    try:
        with pytest.raises(TrialFailed) as caught:  # 64, 32, 16 and 10 are even: every operand stays as it is
            runner.measure(Plan(actions=[PadOps(multiple=2)]), "even", 3)
        assert caught.value.kind == "no_change"
        assert caught.value.message.startswith("no change: its step runs the baseline's XLA programs")
        a, b, cand = runner.measure(Plan(actions=[PadOps(multiple=128)]), "pads", 3)  # 10 -> 128: other programs
        assert len(a) == len(b) == 3 and cand.programs is not None
        assert cand.programs != runner.baseline.programs and runner.baseline.programs is not None
    finally:
        runner.close()


def test_who_may_be_told_by_programs(tmp_path):
    runner = Runner(tmp_path / "x.py", [], TuneOptions(), tmp_path / "run")
    assert runner._may_be_no_op(Plan(actions=[PadOps(multiple=8)]))
    assert not runner._may_be_no_op(Plan())  # the baseline itself
    assert not runner._may_be_no_op(Plan(actions=[Compile(mode="fused")]))  # the same programs, dispatched otherwise
    assert not runner._may_be_no_op(Plan(actions=[PadBatch(buckets=(32, 64), values={"0": 0})]))  # one step's batch is not every step's
    runner.fresh_baselines = True  # shapes that change from step to step
    assert not runner._may_be_no_op(Plan(actions=[PadOps(multiple=8)]))
    ranks = Runner(tmp_path / "x.py", [], TuneOptions(nproc=2), tmp_path / "run")
    assert not ranks._may_be_no_op(Plan(actions=[PadOps(multiple=8)]))  # collectives run outside the programs


class NoChangeRunner:
    verifications = 0
    script_failure = None
    last_baseline_steps: list = []

    def measure(self, plan, name, pairs, report=None, fresh_baseline=False):
        raise TrialFailed("no_change", "no change: its step runs the baseline's XLA programs, each as often")

    def close(self):
        pass


def test_no_change_is_never_verified_and_an_ablation_drops_it():
    verdict = verify(Plan(actions=[PadOps(multiple=2)]), Measuring(NoChangeRunner(), TuneOptions()))
    assert not verdict.accepted and verdict.reason.startswith("no change") and verdict.speed is None
    unit = Attribution(group="padding", actions="pad_ops", without="fused", reason="no change: ...", no_change=True)
    assert why_dropped(unit, 0.05) == "no change: ..."
    assert why_dropped(unit.model_copy(update={"no_change": False}), 0.05) is None  # not measured: not judged
