"""The paired runner on real processes: a script's own end, and the workspaces of a plan measured again."""

from __future__ import annotations

import textwrap

import pytest

from tpu_agent.config import TuneOptions
from tpu_agent.measure.runner import Runner
from tpu_agent.plan.actions import PadDim, Plan


def test_a_unit_measured_again_gets_its_own_workspace_and_log(tmp_path):
    """The smaller plan's ablation measures `ablate-padding-model` a second time: a new workspace, not an error."""
    (tmp_path / "train.py").write_text("WIDTH = 63\n")
    plan = Plan(actions=[PadDim(file="train.py", line=1, column=8, old=63, new=64, name="WIDTH")])
    runner = Runner(tmp_path / "train.py", [], TuneOptions(), tmp_path / "run")
    first, again = runner.process(plan, "ablate-padding-model-with"), runner.process(plan, "ablate-padding-model-with")
    assert (first.name, again.name) == ("ablate-padding-model-with", "ablate-padding-model-with-2")
    assert first.script != again.script and again.script.read_text() == "WIDTH = 64\n"


FAILS_AT_END = """\
    import torch
    model = torch.nn.Linear(8, 4).to("tpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(16, 8).to("tpu")
    for i in range(9):
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
    raise RuntimeError("checkpoint reload failed")
"""


@pytest.mark.slow  # a script in processes (about 20 s)
def test_a_script_that_fails_after_its_steps_is_measured_up_to_there_and_its_failure_kept_once(tmp_path):
    script = tmp_path / "ends_badly.py"
    script.write_text(textwrap.dedent(FAILS_AT_END))
    runner = Runner(script, [], TuneOptions(steps=10, warmup=1), tmp_path / "run")
    try:
        a, b, _ = runner.measure(Plan(), "trial-0", 10)
    finally:
        runner.close()
    assert len(a) == len(b) == 8  # steps 2-9: after the warm-up step, before the script's own end
    steps, error = runner.script_failure
    assert steps == 9 and "checkpoint reload failed" in error
