"""`tpu-agent tune` in-process with every process faked: a given proposer, a FakeRunner, hand-made profiles."""

from __future__ import annotations

import io
from functools import partial
from pathlib import Path

from rich.console import Console

from support.fake_profiles import make_profile
from support.fake_runner import FACTORS, FakeRunner
from tpu_agent import pipeline
from tpu_agent.config import TuneOptions
from tpu_agent.profilers.schema import Profile
from tpu_agent.propose.base import ProposalRound, Proposer
from tpu_agent.propose.candidates import ActionTemplate, Candidate


class TwoGroups(Proposer):
    """Operand padding and fused execution: a verified plan of two groups, so it is ablated."""

    name = "offline"

    def propose(self, profile, knobs=(), playbooks=None, results=(), round=1):
        return ProposalRound(proposer="offline", requested="offline", candidates=[
            Candidate(id="pad", title="operand padding", proposer="offline", rank=1, preserves_numerics=True,
                      actions=[ActionTemplate(kind="pad_ops", choices={"multiple": [8, 16, 32]})]),
            Candidate(id="fuse", title="fused execution", proposer="offline", rank=2, preserves_numerics=True,
                      actions=[ActionTemplate(kind="compile", fixed={"mode": "fused"})]),
        ])


class Padding(Proposer):
    """Operand padding alone, to one of `multiples`: one group, searched over its options."""

    name = "offline"

    def __init__(self, multiples=(8, 16, 32, 64)):
        self.multiples = list(multiples)

    def propose(self, profile, knobs=(), playbooks=None, results=(), round=1):
        return ProposalRound(proposer="offline", requested="offline", candidates=[
            Candidate(id="pad", title="operand padding", proposer="offline", rank=1, preserves_numerics=True,
                      actions=[ActionTemplate(kind="pad_ops", choices={"multiple": self.multiples})])])


def fake_profile(script, args, run_dir, options, plan=None, baseline: Profile | None = None):
    """The baseline at 10 ms a step (or `baseline`); the verified plan at 7.2 ms (0.8 x 0.9) with its own memory
    figures."""
    if plan is None and baseline is not None:
        profile = baseline.model_copy(update={"script": str(script)})
    else:
        profile = make_profile(script=str(script), step_s=0.010 if plan is None else 0.0072,
                               xla_peak=(100 if plan is None else 90) << 20)
    path = Path(run_dir) / ("baseline-profile.json" if plan is None else "plan-profile.json")
    path.write_text(profile.model_dump_json())
    return profile, path


def interrupted_profile(script, args, run_dir, options, plan=None):
    if plan is not None:
        raise KeyboardInterrupt
    return fake_profile(script, args, run_dir, options)


def tune(project: Path, monkeypatch, proposer, *, trials: int, interrupt_at=None, resume=False, allow=(),
         profile: Profile | None = None, factors=FACTORS):
    """pipeline.tune in-process on project/train.py: `proposer`'s candidates, measured by a FakeRunner
    (interrupted at `interrupt_at`; ('profile', 1): in the verified plan's profile), the baseline `profile`."""
    runner = FakeRunner(interrupt_at=interrupt_at if interrupt_at != ("profile", 1) else None, factors=factors)
    profiled = partial(fake_profile, baseline=profile)
    monkeypatch.setattr(pipeline, "Runner", lambda *args, **kwargs: runner)
    monkeypatch.setattr(pipeline, "profile_for_tune", interrupted_profile if interrupt_at == ("profile", 1) else
                        profiled)
    monkeypatch.setattr(pipeline, "make_proposer", lambda *args, **kwargs: proposer)
    options = TuneOptions(trials=trials, seed=0, study="s", resume=resume, storage=f"sqlite:///{project / 's.db'}",
                          output_dir=str(project / "runs"), allow=list(allow))
    out = io.StringIO()
    result, files = pipeline.tune(project / "train.py", [], options, console=Console(file=out, width=200),
                                  proposer="offline")
    return result, runner, out.getvalue()
