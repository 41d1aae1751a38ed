"""`tune --apply`: the source edits written, and the plan's run-time parts named with how to get them."""

from __future__ import annotations

from pathlib import Path

from tpu_agent.plan.actions import Compile, MatmulPrecision, PadDim, Plan
from tpu_agent.plan.patch import apply_patch


def test_apply_says_which_run_time_parts_it_did_not_apply(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("WIDTH = 63\n")
    plan = Plan(actions=[PadDim(file="train.py", line=1, column=8, old=63, new=64, name="WIDTH"),
                         Compile(mode="fused"), MatmulPrecision(precision="highest")])
    said: list[str] = []
    apply_patch(plan, tmp_path / "train.py", force=True, say=said.append)
    assert (tmp_path / "train.py").read_text() == "WIDTH = 64\n"
    applied, not_applied = said
    assert applied.startswith("applied to train.py")
    assert not_applied.startswith("not applied (run-time parts of the plan, not source edits): fused execution")
    assert "torch.tpu.Precision.HIGHEST" in not_applied
    assert not_applied.endswith("`tpu-agent run SCRIPT --plan plan.json` applies them all")
