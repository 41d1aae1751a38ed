"""A change that changes nothing is found from the baseline's profile, said in one line, and never measured:
neither by a trial of the search nor by the verification (in process, with a FakeRunner)."""

from __future__ import annotations

from types import SimpleNamespace

import optuna
import pytest
from rich.console import Console

from support.fake_runner import FakeRunner
from tpu_agent.config import TuneOptions
from tpu_agent.measure.context import Measuring
from tpu_agent.measure.noop import effective, no_change
from tpu_agent.plan.actions import Compile, MatmulPrecision, PadDim, PadOps, Plan
from tpu_agent.propose.candidates import ActionTemplate, Candidate
from tpu_agent.search.loop import search
from tpu_agent.search.rounds import without_no_ops
from tpu_agent.search.space import Space
from tpu_agent.search.study import open_study
from tpu_agent.verify.best import verify_best


def profile(tmp_path, dims=((128, 512, 256),), source="x = 1\n", mode="eager"):
    """What the checks read of a baseline profile: the script, the dots and convolutions, the mode it ran in."""
    script = tmp_path / "train.py"
    script.write_text(source)
    ops = [SimpleNamespace(m=m, k=k, n=n) for m, k, n in dims]
    return SimpleNamespace(script=str(script), padding=SimpleNamespace(ops=ops), modules=None,
                           settings=SimpleNamespace(mode="eager"), mode_used=mode)


def test_what_counts_as_no_change(tmp_path):
    aligned = profile(tmp_path)
    assert "already runs" in no_change(MatmulPrecision(precision="default"), aligned)
    assert no_change(MatmulPrecision(precision="highest"), aligned) is None  # another precision: a change
    assert "already a multiple of 128" in no_change(PadOps(multiple=128), aligned)
    assert no_change(PadOps(multiple=256), aligned) is None  # 128 is not a multiple of 256
    assert "no matmul or convolution dim" in no_change(PadOps(multiple=128, sizes=(50257,)), aligned)
    assert no_change(Compile(mode="eager"), aligned) is not None and no_change(Compile(mode="fused"), aligned) is None
    assert no_change(PadDim(file="t.py", line=1, column=0, old=64, new=64), aligned) is not None
    assert no_change(PadDim(file="t.py", line=1, column=0, old=63, new=64), aligned) is None
    odd = profile(tmp_path, dims=((50, 2032, 255),))
    assert no_change(PadOps(multiple=8), odd) is None
    assert no_change(PadOps(multiple=8, sizes=(2032,)), odd) is not None  # 2032 = 254 x 8 already
    # A script that sets its own precision: its baseline's precision is not known to be DEFAULT.
    own = profile(tmp_path, source="torch.tpu.set_precision(torch.tpu.Precision.HIGHEST)\n")
    assert no_change(MatmulPrecision(precision="default"), own) is None
    assert no_change(MatmulPrecision(precision="default"), None) is None  # no profile: nothing is claimed
    # A CPU host computes f32 matmuls the same at every precision: a TPU's change, never measured here.
    cpu = profile(tmp_path)
    cpu.device = SimpleNamespace(platform="cpu")
    assert "JAX platform cpu" in no_change(MatmulPrecision(precision="highest"), cpu)
    cpu.device = SimpleNamespace(platform="gpu")
    assert no_change(MatmulPrecision(precision="highest"), cpu) is None


def test_precision_is_bit_identical_on_a_cpu_host():
    """What the CPU rule rests on: the device's matmul at each precision gives the same bits on this host."""
    import torch

    if torch.tpu.get_device_name() and __import__("jax").default_backend() != "cpu":
        pytest.skip("a host whose matmuls depend on the precision")
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(127, 255, generator=gen), torch.randn(255, 63, generator=gen)
    outs = []
    for mode in (torch.tpu.Precision.DEFAULT, torch.tpu.Precision.HIGH, torch.tpu.Precision.HIGHEST):
        with torch.tpu.precision(mode):
            outs.append(torch.tanh(x.to("tpu") @ w.to("tpu")).cpu())
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_effective_plan_and_its_lines(tmp_path):
    plan = Plan(actions=[PadOps(multiple=8), MatmulPrecision(precision="default")])
    kept, said = effective(plan, profile(tmp_path, dims=((50, 2032, 255),)))
    assert kept == Plan(actions=[PadOps(multiple=8)])
    assert said == ['no change: matmul_precision {"precision":"default"}: matmul precision default is the '
                    'precision the device already runs']


class _Watcher:
    def __init__(self):
        self.console, self.verdicts, self.seen = Console(record=True, width=200), [], []

    def enter(self, phase): pass

    def verifying(self, plan): self.seen.append(plan)

    def verified(self, verdict): self.verdicts.append(verdict)

    def standing(self, verdict): pass

    def script_failure(self, failure): pass


def test_a_no_op_plan_is_never_measured_by_the_verification(tmp_path):
    runner, watcher = FakeRunner(), _Watcher()
    plans = [Plan(actions=[MatmulPrecision(precision="default")]),
             Plan(actions=[Compile(mode="fused"), MatmulPrecision(precision="default")])]
    verify_best(plans, Measuring(runner, TuneOptions(seed=0), profile=profile(tmp_path)), watcher)
    measured = {m[0].rsplit("-", 1)[0] for m in runner.measured}
    assert measured == {"verify-1"}  # the second plan only, as its real change alone
    assert {m[1:] for m in runner.measured} == {("execution (numerics)",)}
    assert watcher.seen == [Plan(actions=[Compile(mode="fused")])]
    text = watcher.console.export_text()
    assert "no change: matmul_precision" in text and "(not measured)" in text and "(left out of the plan)" in text


def space() -> Space:
    cands = [Candidate(id="prec", title="precision", proposer="offline", rank=1, preserves_numerics=False,
                       actions=[ActionTemplate(kind="matmul_precision", fixed={"precision": "default"})]),
             Candidate(id="pad", title="operand padding", proposer="offline", rank=2, preserves_numerics=True,
                       actions=[ActionTemplate(kind="pad_ops", choices={"multiple": [8, 128]})])]
    return Space(candidates=cands, options={c.id: c.options() for c in cands})


def test_the_search_never_spends_a_trial_on_a_no_op(tmp_path):
    sp, said = space(), set()
    lines = without_no_ops(sp, profile(tmp_path, dims=((48, 136, 256),)), said)  # 8 pads nothing, 128 does
    assert [c.id for c in sp.candidates] == ["pad"] and sp.options["pad"] == [(PadOps(multiple=128),)]
    assert len(lines) == 2 and all(line.startswith("no change: ") and line.endswith("(not searched)")
                                   for line in lines)
    assert without_no_ops(sp, profile(tmp_path, dims=((48, 136, 256),)), said) == []  # said once
    options = TuneOptions(trials=5, seed=0, steps=5, storage=f"sqlite:///{tmp_path / 'studies.db'}")
    runner = FakeRunner()
    search(open_study(options, "s", "fp", tmp_path), sp, Measuring(runner, options), on_note=lambda _: None)
    assert runner.measured and all(m[1:] == ("padding",) for m in runner.measured)
    assert not any("precision" in u for m in runner.measured for u in m[1:])
