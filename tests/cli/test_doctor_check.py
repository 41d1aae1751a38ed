"""`tpu-agent doctor --check`: the device exercised on every local JAX device (here 4 simulated CPU devices),
each result checked against PyTorch on the CPU; the failure lines and exit status from the child's rows."""

from __future__ import annotations

import json
from pathlib import Path

from support.processes import clean_env, run_tool

from tpu_agent.run.device_check import summarize

CHECKS = ["eager op", "fused step", "compiled step", "host -> device", "device -> host",
          "all-reduce (local devices)"]


def test_doctor_check_passes_on_four_simulated_devices(tmp_path: Path):
    proc = run_tool("doctor", "--check", "--devices", "4", "--json", cwd=tmp_path, env=clean_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)["check"]
    assert report["failures"] == []
    assert report["header"]["local_devices"] == ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
    rows = report["rows"]
    for device in report["header"]["local_devices"]:
        mine = [r for r in rows if r["device"] == device]
        assert [r["check"] for r in mine] == CHECKS
        assert all(r["ok"] and r["first_ms"] > 0 and r["warm_ms"] > 0 for r in mine), mine


def _row(device, check, ok=True, detail=""):
    return json.dumps({"device": device, "check": check, "ok": ok, "first_ms": 1.0 if ok else None,
                       "warm_ms": 1.0 if ok else None, "detail": detail})


HEADER = json.dumps({"platform": "tpu", "device_kind": "TPU v5 lite", "local_devices": ["tpu:0", "tpu:1"],
                     "process_index": 0, "process_count": 1})


def test_a_failed_check_is_one_line_naming_the_device_and_the_check():
    lines = [HEADER, _row("tpu:0", "eager op"), _row("tpu:1", "compiled step", False,
                                                     "AssertionError: the compiled step's losses differ"),
             json.dumps({"done": True})]
    report = summarize(lines, 0)
    assert report.failures == ["tpu:1: compiled step: AssertionError: the compiled step's losses differ"]
    assert len(report.rows) == 2 and report.header["device_kind"] == "TPU v5 lite"


def test_a_check_process_that_dies_names_the_check_it_was_in():
    lines = [HEADER, _row("tpu:0", "eager op"), json.dumps({"device": "tpu:0", "check": "fused step", "start": True})]
    report = summarize(lines, -11, "...\nFatal Python error: Segmentation fault\n")
    assert report.failures == ["tpu:0: fused step: the check process stopped (exit status -11): Fatal Python error: "
                               "Segmentation fault"]
    assert summarize([HEADER], None).failures == ["before its first check: the check process stopped (timed out)"]
