"""Peaks for MFU: TPU datasheet figures by device kind, the CPU calibration and its cache."""

from __future__ import annotations

import json

import pytest

from tpu_agent.profilers import peaks


@pytest.mark.parametrize(("kind", "name"), [
    ("TPU v4", "v4"), ("TPU v5 lite", "v5e"), ("TPU v5e", "v5e"), ("TPU v5p", "v5p"), ("TPU v5", "v5p"),
    ("TPU v6 lite", "v6e"), ("TPU v6e", "v6e"), ("TPU7x", "v7x"), ("TPU v7", "v7x"),
])
def test_tpu_generation_from_device_kind(kind, name):
    assert peaks.tpu_generation(kind).name == name


def test_tpu_peak_is_the_datasheet_figure():
    peak = peaks.device_peak("tpu", "TPU v5 lite", 4)
    assert (peak.flops_per_s, peak.dtype, peak.measured) == (197e12, "bfloat16", False)
    assert "cloud.google.com/tpu/docs/v5e" in peak.source
    notes = []
    assert peaks.device_peak("tpu", "TPU v99", 1, notes=notes) is None and notes


def test_cpu_peak_is_measured_once_then_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("TPU_AGENT_CACHE_DIR", str(tmp_path / "cache"))
    measured = []
    monkeypatch.setattr(peaks, "calibrate", lambda: measured.append(1) or 123e9)
    first = peaks.device_peak("cpu", "cpu", 1)
    assert (first.flops_per_s, first.measured, len(measured)) == (123e9, True, 1)
    assert "cache" in first.source
    again = peaks.device_peak("cpu", "cpu", 1)
    assert again.flops_per_s == 123e9 and len(measured) == 1
    # Another device count is another machine configuration.
    peaks.device_peak("cpu", "cpu", 2)
    assert len(measured) == 2
    assert len(json.loads((tmp_path / "cache" / "peaks.json").read_text())) == 2
    # Cache only: nothing measured.
    assert peaks.device_peak("cpu", "cpu", 3, measure=False) is None and len(measured) == 2


def test_a_broken_or_unwritable_cache_does_not_lose_the_figure(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "peaks.json").write_text("{not json")
    monkeypatch.setenv("TPU_AGENT_CACHE_DIR", str(cache))
    monkeypatch.setattr(peaks, "calibrate", lambda: 5e9)
    assert peaks.device_peak("cpu", "cpu", 1).flops_per_s == 5e9
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("TPU_AGENT_CACHE_DIR", str(blocker / "cache"))
    notes = []
    assert peaks.device_peak("cpu", "cpu", 1, notes=notes).flops_per_s == 5e9
    assert notes and "could not cache" in notes[0]
