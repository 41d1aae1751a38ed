"""report.md's lines that say where a figure comes from."""

from __future__ import annotations

from support.paths import DATA
from tpu_agent.config import TuneOptions
from tpu_agent.profilers.schema import Profile
from tpu_agent.report.markdown import _measured_on
from tpu_agent.report.result import TuneResult, summary_of


def _result(target: str) -> TuneResult:
    profile = Profile.model_validate_json((DATA / "profile_odd_mlp.json").read_text())
    return TuneResult(script="train.py", args=[], settings=TuneOptions(target=target), study="s", storage="-",
                      run_dir="/tmp/r", summary=summary_of(profile, None))


def test_the_report_says_the_steps_ran_on_this_host_never_on_the_target_it_tiles_for():
    result = _result("v5e")
    device = result.summary.device
    assert device and "cpu" in device
    line = _measured_on(result)
    assert line == f"this host (JAX devices: {device}; shapes tiled for v5e)"  # it said "Measured on v5e"
    assert not line.startswith("v5e")
    assert _measured_on(_result("cpu")) == f"this host (JAX devices: {device})"
