"""Ctrl-C stops a run even when its KeyboardInterrupt lands in a finaliser, where plain Python prints
"Exception ignored" and runs on (a tune's baseline once slept on after Ctrl-C)."""

from __future__ import annotations

import textwrap
from pathlib import Path

from support.processes import clean_env, run_python, run_tool

SWALLOWED = textwrap.dedent("""
    import os, signal, time

    class Resource:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C arrives while a finaliser runs
            time.sleep(0.2)

    Resource()
    print("after the finaliser", flush=True)
    time.sleep(1)  # the run stops here (the interrupt raised again 0.05 s after the finaliser); plain python sleeps on
    print("ran to the end", flush=True)
""")


def test_an_interrupt_swallowed_by_a_finaliser_still_stops_the_run(tmp_path: Path):
    (tmp_path / "swallow.py").write_text(SWALLOWED)
    plain = run_python("swallow.py", cwd=tmp_path, env=clean_env(TPU_AGENT_DEVICE="off"))
    assert plain.returncode == 0 and "ran to the end" in plain.stdout  # Python itself loses it
    assert "Exception ignored" in plain.stderr

    ours = run_tool("run", "-q", "swallow.py", cwd=tmp_path)
    assert ours.returncode == 130, ours.stderr
    assert "after the finaliser" in ours.stdout and "ran to the end" not in ours.stdout
    assert ours.stderr.rstrip().endswith("KeyboardInterrupt"), ours.stderr
