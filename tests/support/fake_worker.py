"""A worker process of a study as `--workers N` starts one (tpu_agent.search.worker, its spec on stdin), measuring
with a FakeRunner that takes `SLOW_S` per trial. Heartbeats every second, stale after GRACE_S. With FAKE_WORKER_HANG
naming its folder (worker-2), it hangs in its first trial after writing its pid to FAKE_WORKER_HANG_FILE, as if
on another host (only its heartbeat can say it died), until the test SIGKILLs it."""

from __future__ import annotations

import io
import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from support.fake_runner import FakeRunner  # noqa: E402
from tpu_agent.search import storage, worker  # noqa: E402
from tpu_agent.search import loop  # noqa: E402

SLOW_S = 0.2


class SlowRunner(FakeRunner):
    """FakeRunner whose trials take SLOW_S (so that workers overlap); `hang_file`: its second trial hangs."""

    def __init__(self, *args, hang_file: str | None = None, gate=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.hang_file, self.gate, self.trials = hang_file, gate, 0

    def measure(self, plan, name, pairs, report=None, fresh_baseline=False):
        self.trials += 1
        if self.gate is not None:
            self.gate(self.trials)
        if self.hang_file and self.trials == 1:
            Path(self.hang_file).write_text(f"{os.getpid()} {name}")
            threading.Event().wait()  # until SIGKILL
        time.sleep(SLOW_S)
        return super().measure(plan, name, pairs, report, fresh_baseline)


# A live worker whose heartbeat thread is starved longer than the grace (a loaded 2-core CI host: the lead's
# trial was failed as stale 2.6 s after it started with a grace of 2 s) is taken for dead: 8 s keeps the test
# quick and the kill still found.
GRACE_S = 8
# A test where no worker dies sets a longer grace for its worker processes here (a trial that runs through a
# server outage loses its heartbeat: Optuna's heartbeat thread ends at the first failed write).
GRACE_VARIABLE = "FAKE_WORKER_GRACE_S"


def quick_heartbeat() -> None:
    storage.HEARTBEAT_S, storage.GRACE_S = 1, float(os.environ.get(GRACE_VARIABLE, GRACE_S))


if __name__ == "__main__":
    quick_heartbeat()
    hang = os.environ.get("FAKE_WORKER_HANG")
    runner = SlowRunner()
    spec = json.loads(sys.stdin.read())
    if hang and spec["run_dir"].endswith(hang):
        runner.hang_file = os.environ["FAKE_WORKER_HANG_FILE"]
        loop.owner = lambda: {"host": "another-host", "pid": os.getpid()}
    sys.stdin = io.StringIO(json.dumps(spec))
    sys.exit(worker.main(runner=runner))
