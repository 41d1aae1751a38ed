"""examples/autocast_cnn.py, unchanged: bf16 autocast, a pinned DataLoader, checkpoints and resume give plain
python's CPU losses under `tpu-agent run` (within bf16 tolerance), and a resumed run continues exactly."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from support.paths import EXAMPLES
from support.processes import clean_env, run_python, run_tool

SCRIPT = str(EXAMPLES / "autocast_cnn.py")
BF16_REL = 2e-2  # bf16 keeps 8 bits of mantissa: a rounding apart is 0.4 %, and 8 AdamW steps add to it


def losses(stdout: str) -> dict[int, float]:
    assert re.search(r"^step=\d+ loss=\S+ dtype=torch.bfloat16$", stdout, re.M), stdout  # autocast ran
    return {int(s): float(v) for s, v in re.findall(r"^step=(\d+) loss=(\S+)", stdout, re.M)}


def device(stdout: str) -> str:
    (found,) = re.findall(r"^device=(\w+)$", stdout, re.M)
    return found


@pytest.mark.slow
def test_bf16_autocast_cnn_trains_like_the_cpu_and_resumes_where_it_stopped(tmp_path: Path):
    cpu = run_python(SCRIPT, "--steps", "8", "--checkpoint", "cpu.pt", cwd=tmp_path,
                     env=clean_env(TPU_AGENT_DEVICE="off"))  # before the tool was installed
    assert cpu.returncode == 0, cpu.stderr[-3000:]
    assert device(cpu.stdout) == "cpu"

    # The uninterrupted run saves its checkpoint after step 5 (only then: 8 is no multiple of 5), as a run stopped
    # there would have left it.
    whole = run_tool("run", "-q", SCRIPT, "--", "--steps", "8", "--save-every", "5", "--checkpoint", "t.pt",
                     cwd=tmp_path, timeout=300)
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert device(whole.stdout) == "tpu"
    expected, actual = losses(cpu.stdout), losses(whole.stdout)
    assert list(actual) == list(range(1, 9))
    for step, value in expected.items():
        assert actual[step] == pytest.approx(value, rel=BF16_REL), (step, value, actual[step])

    resumed = run_tool("run", "-q", SCRIPT, "--", "--steps", "8", "--checkpoint", "t.pt", "--resume",
                       cwd=tmp_path, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = losses(resumed.stdout)
    assert list(after) == [6, 7, 8]  # torch.load(map_location=tpu) of the step-5 checkpoint
    for step, value in after.items():  # the same device, the same batches: the same losses
        assert value == pytest.approx(actual[step], rel=1e-5), (step, value, actual[step])
