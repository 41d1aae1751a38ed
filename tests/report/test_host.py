"""The first lines of report.md and the console's verdict say where the gains were measured (host CPU model, JAX
platform, device count), and with --target a TPU on another host, what is measured here and what is estimated."""

from __future__ import annotations

from rich.console import Console

from support.paths import DATA
from tpu_agent.config import TuneOptions
from tpu_agent.profilers.schema import Profile
from tpu_agent.report.console import TuneLines
from tpu_agent.report.markdown import markdown
from tpu_agent.report.result import TuneResult, cpu_model, measured_on, summary_of


def _result(target: str) -> TuneResult:
    profile = Profile.model_validate_json((DATA / "profile_odd_mlp.json").read_text())
    return TuneResult(script="train.py", args=[], settings=TuneOptions(target=target), study="s", storage="-",
                      run_dir="/tmp/r", summary=summary_of(profile, None), host=measured_on(profile))


def test_measured_on_names_the_cpu_the_platform_and_the_devices():
    profile = Profile.model_validate_json((DATA / "profile_odd_mlp.json").read_text())
    line = measured_on(profile)
    assert line.startswith(cpu_model() + " (")
    assert f"JAX platform {profile.device.platform}, {profile.device.count} device" in line
    assert cpu_model() and cpu_model() != "unknown CPU"


def test_report_md_first_lines_say_where_it_was_measured():
    lines = markdown(_result("cpu"), {}).splitlines()
    assert lines[0] == "## tpu-agent: train.py"
    assert lines[2].startswith("*Measured on:* ") and "JAX platform cpu" in lines[2]
    assert not any(line.startswith("*Measured here, estimated for") for line in lines)


def test_a_tpu_target_on_a_cpu_host_separates_measured_from_estimated():
    text = markdown(_result("v5e"), {})
    assert "*Measured here, estimated for v5e:*" in text.splitlines()[4]
    assert "estimates, never verified here" in text


def test_the_console_verdict_says_the_host():
    console = Console(record=True, width=300)
    TuneLines(console).host(_result("v5e"))
    out = console.export_text().splitlines()
    assert out[0].startswith("  measured on ") and "JAX platform cpu" in out[0]
    assert "figures for v5e" in out[1]


def test_several_slices_are_named_as_the_target_the_estimates_are_for():
    result = _result("v5e-4").model_copy(update={"settings": TuneOptions(target="v5e-4", slices=2)})
    assert "*Measured here, estimated for 2xv5e-4:*" in markdown(result, {})
    console = Console(record=True, width=300)
    TuneLines(console).host(result)
    assert "figures for 2xv5e-4" in console.export_text()


def test_an_n_rank_baseline_names_its_processes():
    from tpu_agent.profilers.schema import Distributed

    profile = Profile.model_validate_json((DATA / "profile_odd_mlp.json").read_text())
    assert "processes" not in measured_on(profile)
    profile.distributed = Distributed(world_size=2)
    assert measured_on(profile).endswith(f"{profile.device.count} device in each of 2 processes (ranks)")
