"""The host's measuring slots: timed work on one host is serialized across processes, a dead holder frees its
slot, and a holder may re-enter its own slot (a baseline restarted inside a pair)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from tpu_agent import envvars
from tpu_agent.measure import slots

HOLDER = textwrap.dedent("""\
    import sys, time, tempfile
    tempfile.tempdir = sys.argv[1]
    from tpu_agent.measure import slots
    with slots.held(int(sys.argv[2])) as slot:
        print(slot, flush=True)
        time.sleep(float(sys.argv[3]))
        open(sys.argv[4], "w").write("released")
""")


@pytest.fixture
def tmp_slots(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def holder(tmp_path, n: int, seconds: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path), str(n), str(seconds),
                             str(tmp_path / f"released-{seconds}")], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() in {"0", "1"}  # it holds a slot now
    return proc


def test_a_slot_taken_by_another_process_is_waited_for(tmp_slots):
    proc = holder(tmp_slots, 1, 1.0)
    with slots.held(1):
        assert (tmp_slots / "released-1.0").read_text() == "released"  # taken only after the other let go
    proc.wait(10)


def test_two_slots_are_held_at_once(tmp_slots):
    proc = holder(tmp_slots, 2, 1.0)
    with slots.held(2) as slot:
        assert slot == 1 and not (tmp_slots / "released-1.0").exists()  # the free one, without waiting
    proc.wait(10)


def test_a_killed_holder_frees_its_slot(tmp_slots):
    proc = holder(tmp_slots, 1, 60.0)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    t0 = time.monotonic()
    with slots.held(1):
        assert time.monotonic() - t0 < 30  # not the holder's 60 s
    assert not (tmp_slots / "released-60.0").exists()


def test_a_holder_re_enters_its_own_slot(tmp_slots):
    with slots.held(1) as outer:
        with slots.held(1) as inner:  # no deadlock on its own lock
            assert inner == outer
    proc = holder(tmp_slots, 1, 0.0)  # and it was let go
    proc.wait(10)


def test_the_count_is_one_setting(monkeypatch):
    monkeypatch.setenv(envvars.MEASURE_SLOTS.name, "3")
    assert slots.count() == 3
    monkeypatch.setenv(envvars.MEASURE_SLOTS.name, "0")
    with pytest.raises(ValueError, match="TPU_AGENT_MEASURE_SLOTS"):
        slots.count()
    monkeypatch.delenv(envvars.MEASURE_SLOTS.name)
    assert slots.count() == max(1, (os.cpu_count() or 1) // 2)
