"""The tune's baseline: a failing, hanging or interrupted baseline stops the tune with its own exit code."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from support.processes import clean_env, run_tool
from support.tune import ctrl_c, read_or_empty, runs, start_tool, tune_phase, wait_for

pytestmark = pytest.mark.slow

STUCK_AT_STEP_3 = textwrap.dedent("""
    import time, torch
    m = torch.nn.Linear(4, 4).to("tpu")
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x = torch.randn(2, 4).to("tpu")
    for i in range(100):
        opt.zero_grad(); m(x).sum().backward(); opt.step(); print(f"step={i}")
        if i == 2:
            time.sleep(3600)
""")


def tune(project: Path, script: str, *args: str, timeout: float = 240):
    return run_tool("tune", script, "--trials", "2", "--storage", f"sqlite:///{project / 'studies.db'}", *args,
                    cwd=project, env=clean_env(), timeout=timeout)


def test_a_failing_baseline_stops_the_tune_with_the_scripts_own_message_and_piped_output_is_not_wrapped(
        tmp_path: Path):
    """One tune whose baseline fails at once checks both (a tune's start-up fewer): the script's own message and
    the one error line; and its output, piped, is not wrapped at 80 columns (the script's name alone is longer)."""
    name = "a_training_script_with_a_name_long_enough_to_pass_eighty_columns_on_its_own.py"
    (tmp_path / name).write_text("import argparse\np = argparse.ArgumentParser()\n"
                                 "p.add_argument('--data', required=True)\np.parse_args()\n")
    proc = tune(tmp_path, name)
    assert proc.returncode == 1, proc.stderr
    assert "the following arguments are required: --data" in proc.stderr  # the script's own words
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: the baseline run of {name} failed (exit 2)"), proc.stderr
    assert "Traceback" not in proc.stderr and "search" not in proc.stdout
    assert f"baseline: profiling {name} (2 warm-up + 20 steps)" in proc.stdout.splitlines(), proc.stdout


def test_a_baseline_hanging_before_its_first_step_times_out(tmp_path: Path):
    (tmp_path / "hang.py").write_text("import time\ntime.sleep(3600)\n")
    # the first step gets --trial-timeout twice over (start-up, then the step): 2 s here; the script never steps,
    # so no load makes a shorter limit pass it (2 s: 2 s less waiting than 4, the same line)
    proc = tune(tmp_path, "hang.py", "--trial-timeout", "1", timeout=120)
    assert proc.returncode == 1, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: the baseline run timed out: no progress to the first step within 1 s "
                           "(--trial-timeout)"), line


def test_ctrl_c_during_the_baseline_stops_the_tune(tmp_path: Path):
    # The script's third step never ends: the baseline (2 warm-up + 20 steps) cannot finish before the Ctrl-C,
    # however loaded the machine, and the interrupt is sent only once the tool says the baseline is running
    # and the script has finished a step.
    (tmp_path / "stuck.py").write_text(STUCK_AT_STEP_3)
    proc = start_tool("tune", "stuck.py", "--trials", "2", "--storage", f"sqlite:///{tmp_path / 'studies.db'}",
                      cwd=tmp_path)
    wait_for(lambda: tune_phase(tmp_path) == "baseline" and any(
        "step=1" in read_or_empty(r / "baseline-profile.log") for r in runs(tmp_path)), 180, "the baseline's step 1")
    code, out, err = ctrl_c(proc)
    assert code == 130, err
    assert "interrupted during the baseline" in out and "search" not in out
    (run_dir,) = runs(tmp_path)
    assert (run_dir / "tune.json").exists() and (run_dir / "report.md").exists()
    assert tune_phase(tmp_path) == "done"
