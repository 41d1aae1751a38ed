"""A full `tune` driven by the Claude proposer, with a fake client: its plan searched and verified, the key never
written."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from support.paths import EXAMPLES
from support.claude import FakeClient, message, use
from tpu_agent import pipeline as tune
from tpu_agent.config import TuneOptions
from tpu_agent.propose.claude import ClaudeProposer
from tpu_agent.report import markdown as report

pytestmark = pytest.mark.slow  # whole tunes or every example, end to end

PROPOSAL = {"proposals": [{
    "title": "Pad the convolution channels and run the step as fused XLA graphs",
    "actions": [{"kind": "pad_dim", "knob": "odd_shapes.py:21:7", "choices": {"new": [128]}},
                {"kind": "compile", "choices": {"mode": ["fused"]}}],
    "reason": "127 channels leave vector lanes empty; op-by-op dispatch of many small ops",
    "playbook": "pad-matmul-dims",
}]}


def test_fake_claude_drives_a_full_tune_to_a_verification(tmp_path: Path, monkeypatch):
    key = "sk-ant-test-" + "x" * 24
    monkeypatch.setenv("ANTHROPIC_API_KEY", key)
    client = FakeClient([message([use("profile_summary", {}, "t1")]),
                         message([use("submit_proposals", PROPOSAL, "t2")])])

    def make_proposer(proposer, *, audit_dir, model, token_budget, script):
        return ClaudeProposer(client=client, audit_dir=audit_dir, token_budget=token_budget,
                              source_root=script.parent, say=lambda _m: None)

    monkeypatch.setattr(tune, "make_proposer", make_proposer)
    monkeypatch.chdir(tmp_path)
    # WIDE's channels are the model's (a model change): searched only with allow=model, so Claude is shown that knob
    # verify=1: Claude's best plan goes through a verification (what is checked), not the next two as well
    settings = TuneOptions(trials=2, steps=5, warmup=2, storage=f"sqlite:///{tmp_path / 's.db'}", study="c",
                           allow=["model"], verify=1)
    result = tune.run(EXAMPLES / "odd_shapes.py", [], settings, console=Console(quiet=True), proposer="claude",
                      runs_root=tmp_path / ".tpu-agent" / "runs")
    files = report.write_all(result, EXAMPLES / "odd_shapes.py")

    assert result.proposer == "claude"
    assert [c.proposer for c in result.candidates] == ["claude"]
    # Claude's plan went through the search to a verification in fresh processes. Whether it clears the bar is
    # timing on a shared 2-core machine (once 1.136x, CI 1.015-1.337: not accepted): not asserted here.
    assert result.verdicts and result.verdicts[0].speed is not None and result.verdicts[0].speed.pairs >= 5
    proposed = {("pad_dim", "WIDE", 128), ("compile", None, "fused")}  # every change measured is Claude's
    measured = {(a.kind, getattr(a, "name", None), getattr(a, "new", getattr(a, "mode", None)))
                for plan in [*(t.plan for t in result.trials), *(v.plan for v in result.verdicts)] for a in plan.actions}
    assert measured and measured <= proposed, measured
    assert result.verdicts[0].plan.actions and result.verdicts[0].plan.effects()  # its class is said
    assert "claude" in files["report.md"].read_text()
    assert len(client.requests) == 2  # a tool-use turn, then the proposal
    for path in Path(result.run_dir).rglob("*"):
        if path.is_file():
            assert key.encode() not in path.read_bytes(), path
