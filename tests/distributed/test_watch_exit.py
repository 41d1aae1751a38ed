"""A rank that did all its work exits 0: the collective watch's thread (backend/distributed/faults.py) is never
inside a store call when the interpreter finalizes. CPython ends a daemon thread that takes the GIL back during
finalization, and from inside a pybind call (the GIL released) that unwinds through C++ that cannot be
unwound: `terminate called without an active exception`, SIGABRT, exit 134, after the rank wrote everything.
Under load it happened about once a suite run (a 2-rank job's rank 0, after its last collective)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from support.processes import clean_env

# The watch thread publishes through a store whose set() first waits 1 s in C++ without the GIL (a TCPStore
# get of a key nobody sets, with a 1 s timeout), as a store starved of CPU would. The process exits while the
# thread is in that call, and an object finalized with the module sleeps 2 s (the GIL released) so that the
# call returns while the interpreter finalizes.
RANK = textwrap.dedent("""
    import threading
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from tpu_agent.backend.distributed import faults

    slow, inside = threading.Event(), threading.Event()


    class SlowStore(dist.Store):
        def __init__(self, real):
            super().__init__()
            self.real = real

        def set(self, key, value):
            if slow.is_set():
                inside.set()
                try:
                    self.real.get("never-set")
                except Exception:
                    pass
            self.real.set(key, value)

        def get(self, key):
            return self.real.get(key)

        def check(self, keys):
            return self.real.check(keys)


    class SlowTeardown:
        sleep = staticmethod(time.sleep)

        def __del__(self):
            self.sleep(2)


    real = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=1))
    faults.attach((0, 1), SlowStore(real), 0, timedelta(seconds=60))
    slow.set()
    with faults.watching("all_reduce", (0, 1)):
        pass
    assert inside.wait(30), "the watch thread never published"
    keep = SlowTeardown()
    print("done", flush=True)
""")


def test_a_rank_exits_0_while_its_watch_thread_is_inside_a_store_call(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env=clean_env(TPU_AGENT_DEVICE="off"))
    assert proc.stdout == "done\n", proc.stderr[-2000:]
    assert "terminate called" not in proc.stderr, proc.stderr[-2000:]
    assert proc.returncode == 0, proc.stderr[-2000:]
