"""`tpu-agent diff`: a markdown table of two profiles or reports, exit 1 on a regression, 2 on bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support.processes import one_error_line, run_tool
from support.fake_profiles import make_profile
from tpu_agent.cli.diff import compare
from tpu_agent.errors import InputError
from tpu_agent.report.summary import from_profile, summarize


def write(path: Path, profile) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(profile.model_dump_json())
    return path


def row(rows, label: str):
    return next(r for r in rows if r.metric.label.startswith(label))


def test_summary_of_a_profile() -> None:
    s = from_profile(make_profile(step_s=0.04, flops=3e9, mfu=0.25, xla_peak=1000, live_peak=3000, waste=0.05))
    assert (s.step_time_s, s.flops_per_step, s.mfu, s.peak_memory_bytes, s.live_peak_bytes, s.padding_waste) == (
        0.04, 3e9, 0.25, 1000, 3000, 0.05)
    assert s.script == "train.py" and s.source == "profile"


def test_report_json_is_read_through_its_summary() -> None:
    report = {"schema_version": 1, "whatever": [1, 2], "summary": {"step_time_s": 0.03, "script": "train.py"}}
    s = summarize(report)
    assert s.source == "report" and s.step_time_s == 0.03 and s.mfu is None
    # A bare summary round-trips.
    assert summarize(json.loads(s.model_dump_json())) == s


def test_compare_gates_step_time_and_xla_memory_only() -> None:
    base = from_profile(make_profile(step_s=0.050, flops=2e9, mfu=0.20, xla_peak=100, live_peak=100, waste=0.04))
    head = from_profile(make_profile(step_s=0.056, flops=2.6e9, mfu=0.15, xla_peak=104, live_peak=200, waste=0.01))
    rows = compare(base, head, fail_above=5)
    assert row(rows, "step time").change == pytest.approx(0.12) and row(rows, "step time").regression
    assert not row(rows, "peak memory").regression and row(rows, "peak memory").verdict == "worse"  # +4 % < 5 %
    assert not row(rows, "live memory").regression  # shown, never gated
    assert not row(rows, "FLOPs").regression and row(rows, "FLOPs").verdict == ""
    assert row(rows, "MFU").change == pytest.approx(-0.05) and not row(rows, "MFU").regression
    assert row(rows, "padding").verdict == "better"
    assert not any(r.regression for r in compare(base, head, fail_above=15))
    assert not any(r.regression for r in compare(base, head, fail_above=None))
    faster = from_profile(make_profile(step_s=0.030))
    assert row(compare(base, faster, 1), "step time").verdict == "better"


def test_diff_command_regression_exit_1_and_markdown(tmp_path: Path) -> None:
    base = write(tmp_path / "base" / "profile.json", make_profile(step_s=0.050, xla_peak=100 << 20))
    head = write(tmp_path / "head" / "profile.json", make_profile(step_s=0.060, xla_peak=100 << 20))
    proc = run_tool("diff", str(base), str(head), "--fail-above", "5", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "### tpu-agent diff: train.py"
    assert "| metric | base | head | change | |" in lines
    assert "| step time (median) | 50 ms | 60 ms | +20.0% | **regression** (> 5 %) |" in lines
    assert any(line.startswith("**Regression beyond 5 %:** step time (median) +20.0%") for line in lines)
    # The same pair passes a looser gate; run directories are accepted too.
    ok = run_tool("diff", str(base.parent), str(head.parent), "--fail-above", "25", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert "No regression beyond 25 %" in ok.stdout


@pytest.mark.parametrize(
    "content,message",
    [
        (None, "file not found"),
        ("{not json", "not JSON"),
        ('{"steps": {}, "status": "stopped"}', "not a valid tpu-agent file"),
        ('[1, 2]', "expected a JSON object"),
        ('{"hello": 1}', "not a tpu-agent profile.json or report.json"),
    ],
)
def test_bad_inputs(tmp_path: Path, content: str | None, message: str) -> None:
    path = tmp_path / "x.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(InputError, match=message):
        from tpu_agent.report.summary import load_summary

        load_summary(path)


def test_diff_command_bad_input_is_one_line_exit_2(tmp_path: Path) -> None:
    good = write(tmp_path / "p.json", make_profile())
    (tmp_path / "bad.json").write_text("{")
    proc = run_tool("diff", str(good), "bad.json", cwd=tmp_path)
    assert proc.returncode == 2
    assert one_error_line(proc).startswith("error: bad.json: not JSON")
    neg = run_tool("diff", str(good), str(good), "--fail-above", "-1", cwd=tmp_path)
    assert neg.returncode == 2 and "--fail-above" in one_error_line(neg)


def test_a_directory_without_a_profile_is_named(tmp_path):
    (tmp_path / "empty").mkdir()
    proc = run_tool("diff", "empty", "empty", cwd=tmp_path)
    assert proc.returncode == 2
    assert one_error_line(proc) == ("error: no profile.json or report.json in empty (pass a run directory or one "
                                    "of those files)")
