"""How a tune's processes end when the script does something a timed run cannot go on with (issue #27): a
prompt for terminal input (stdin is the null device: it fails at once, saying why), an exit with status 0 mid-run
(an end, never a crash), a script with no training step (refused before the search, one line)."""

from __future__ import annotations

import textwrap
import time

import pytest

from support.processes import run_tool
from tpu_agent.measure.trials import TrialFailed, TrialProcess
from tpu_agent.plan.actions import Plan

LOOP = """\
    import os
    import torch
    model = torch.nn.Linear(8, 4).to("tpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(16, 8).to("tpu")
    for i in range(20):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        if i == 2:
            {at_step_3}
"""


def _process(tmp_path, at_step_3: str) -> TrialProcess:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(LOOP).format(at_step_3=at_step_3))
    return TrialProcess(script, [], Plan(), cwd=tmp_path, log_dir=tmp_path / "logs", step_timeout=120)


def _steps_until_failure(proc: TrialProcess) -> TrialFailed:
    proc.start()
    try:
        with pytest.raises(TrialFailed) as failed:
            for _ in range(10):
                proc.step()
    finally:
        proc.stop()
    return failed.value


@pytest.mark.slow  # a script in a process (about 8 s)
def test_a_script_that_asks_for_input_fails_its_trial_at_once_saying_why(tmp_path):
    t0 = time.monotonic()
    failed = _steps_until_failure(_process(tmp_path, 'input("continue? ")'))
    assert failed.kind == "crashed" and "EOF when reading a line" in failed.message
    assert "terminal input" in failed.message and "null device" in failed.message
    assert time.monotonic() - t0 < 60  # not the step timeout (120 s)


@pytest.mark.slow  # a script in a process (about 8 s)
def test_a_script_that_exits_0_mid_run_ended_it_did_not_crash(tmp_path):
    failed = _steps_until_failure(_process(tmp_path, "os._exit(0)"))
    assert failed.kind == "too_few_steps", failed.message
    assert "exited with 0" in failed.message


NO_STEP = """\
    import torch
    model = torch.nn.Linear(8, 4).to("tpu")
    x = torch.randn(16, 8).to("tpu")
    for i in range(5):
        y = model(x).square().mean()
    print(float(y))
"""


@pytest.mark.slow  # a baseline profile (about 10 s)
def test_a_script_with_no_training_step_is_refused_before_the_search(tmp_path):
    (tmp_path / "no_step.py").write_text(textwrap.dedent(NO_STEP))
    proc = run_tool("tune", "no_step.py", "--trials", "2", "--offline", cwd=tmp_path, timeout=300)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "no training step was seen in no_step.py" in errors[0], proc.stderr[-2000:]
    assert "optimizer.step()" in errors[0] and "mark_step()" in errors[0]
    assert "search" not in proc.stdout and "Traceback" not in proc.stderr
