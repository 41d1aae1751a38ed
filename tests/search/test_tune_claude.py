"""A full `tune` driven by the Claude proposer, with a fake client: its plan searched and verified, the key never
written."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from rich.console import Console

from support.claude import FakeClient, message, use
from tpu_agent import pipeline as tune
from tpu_agent.config import TuneOptions
from tpu_agent.propose.claude import ClaudeProposer
from tpu_agent.report import markdown as report

pytestmark = pytest.mark.slow  # whole tunes or every example, end to end

# A small MLP whose hidden width (a model size) is one off: the tune's dozen processes start quickly (the bundled
# odd_shapes CNN took 100-160 s for the same checks). Verification follows only a plan the search measured faster,
# so the plan must win by a margin CI's load cannot erase: a 3-layer MLP fused gained 1.25x here and measured 0.90x
# once in CI (no verification, the test failed); 10 layers compiled whole gain 2.7-3.0x (search CI low 1.5-1.7).
SCRIPT = textwrap.dedent("""\
    import argparse
    import torch
    import torch.nn.functional as F
    HIDDEN = 63
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    layers = [torch.nn.Linear(32, HIDDEN), torch.nn.ReLU()]
    for _ in range(8):
        layers += [torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(HIDDEN, 4)).to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(31, 32, generator=g).to("tpu")
    y = torch.randint(0, 4, (31,), generator=g).to("tpu")
    for step in range(args.steps):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        print(f"step={step} loss={loss.item():.6f}")
""")

PROPOSAL = {"proposals": [{
    "title": "Pad the hidden width and compile the whole step",
    "actions": [{"kind": "pad_dim", "knob": "mlp63.py:4:9", "choices": {"new": [64]}},
                {"kind": "compile", "choices": {"mode": ["compiled"]}}],
    "reason": "63 columns leave vector lanes empty; op-by-op dispatch of many small ops",
    "playbook": "pad-matmul-dims",
}]}


def test_fake_claude_drives_a_full_tune_to_a_verification(tmp_path: Path, monkeypatch):
    key = "sk-ant-test-" + "x" * 24
    monkeypatch.setenv("ANTHROPIC_API_KEY", key)
    client = FakeClient([message([use("profile_summary", {}, "t1")]),
                         message([use("submit_proposals", PROPOSAL, "t2")])])

    def make_proposer(proposer, *, audit_dir, token_budget, source_root, **_model):
        return ClaudeProposer(client=client, audit_dir=audit_dir, token_budget=token_budget,
                              source_root=source_root, say=lambda _m: None)

    monkeypatch.setattr(tune, "make_proposer", make_proposer)
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "mlp63.py"
    script.write_text(SCRIPT)
    # HIDDEN is the model's width (a model change): searched only with allow=model, so Claude is shown that knob
    # verify=1: Claude's best plan goes through a verification (what is checked), not the next two as well;
    # processes=1: that verification and each ablation unit in one fresh process pair (the interval's spread over
    # several pairs is not what is checked here: tests/measure/test_process_pairs.py)
    # trials=1: the one trial is the proposal's seed, Claude's plan itself (search/sampling.py's seeds), which the
    # verification needs; a second trial measured a plan of Claude's options too, checked by the same assertion
    settings = TuneOptions(trials=1, steps=5, pairs=5, warmup=2, storage=f"sqlite:///{tmp_path / 's.db'}", study="c",
                           allow=["model"], verify=1, processes=1)
    result = tune.run(script, [], settings, console=Console(quiet=True), proposer="claude",
                      runs_root=tmp_path / ".tpu-agent" / "runs")
    files = report.write_all(result, script)

    assert result.proposer == "claude"
    assert [c.proposer for c in result.candidates] == ["claude"]
    # Claude's plan went through the search to a verification in fresh processes. Whether it clears the bar is
    # timing on a shared 2-core machine (once 1.136x, CI 1.015-1.337: not accepted): not asserted here.
    assert result.verdicts and result.verdicts[0].speed is not None and result.verdicts[0].speed.pairs >= 5
    proposed = {("pad_dim", "HIDDEN", 64), ("compile", None, "compiled")}  # every change measured is Claude's
    measured = {(a.kind, getattr(a, "name", None), getattr(a, "new", getattr(a, "mode", None)))
                for plan in [*(t.plan for t in result.trials), *(v.plan for v in result.verdicts)] for a in plan.actions}
    assert measured and measured <= proposed, measured
    assert result.verdicts[0].plan.actions and result.verdicts[0].plan.effects()  # its class is said
    assert "claude" in files["report.md"].read_text()
    assert len(client.requests) == 2  # a tool-use turn, then the proposal
    for path in Path(result.run_dir).rglob("*"):
        if path.is_file():
            assert key.encode() not in path.read_bytes(), path
