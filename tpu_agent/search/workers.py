"""Several workers filling one study: `--workers N` starts N - 1 worker processes beside the tune on this host;
`--join STUDY` (on any host that reaches the storage) is one more worker. A worker measures the study's plans
against its own warm baseline on its own host (pairs never mix hosts) and records its host on each trial;
verification and ablation stay with the tune that started the study. The study carries what a worker needs:
the search space, the trial budget, the baseline's batch."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import optuna

from tpu_agent.config import TuneOptions
from tpu_agent.plan.actions import Plan
from tpu_agent.propose.candidates import Candidate
from tpu_agent.search.space import Space
from tpu_agent.search.storage import storage_url

# What a worker process runs: this module, its spec (JSON, the storage URL with its password among it) on stdin,
# never on its command line. Tests swap in a script that measures with a fake runner.
WORKER_COMMAND = [sys.executable, "-m", "tpu_agent.search.worker"]
# Between rounds a joined worker polls the study; a new round comes once the proposer has answered (Claude:
# seconds to minutes), so the wait for one is long, and bounded.
ROUND_POLL_S = 1.0
ROUND_WAIT_S = 600.0


def save_space(study: optuna.Study, space: Space, budget: int, baseline_batch: int | None,
               fresh_baselines: bool) -> None:
    """What a joining worker reads: the candidates with their options, the budget, the baseline's batch."""
    study.set_user_attr("space", [{"candidate": c.model_dump(mode="json"),
                                   "options": [Plan(actions=list(o)).model_dump(mode="json")["actions"]
                                               for o in space.options[c.id]]} for c in space.candidates])
    study.set_user_attr("trials", budget)
    study.set_user_attr("baseline_batch", baseline_batch)
    study.set_user_attr("fresh_baselines", fresh_baselines)


def rounds_open(study: optuna.Study, searching: bool) -> None:
    """Whether the tune that started the study may still add a round (a larger budget, more candidates): its
    joined workers wait for one rather than stop when the study holds the current budget."""
    study.set_user_attr("searching", searching)


def next_round(study: optuna.Study, budget: int, say, wait_s: float | None = None) -> int | None:
    """The study's next budget once the tune starts another round; None when its search is over, or after
    `wait_s` (ROUND_WAIT_S) without one (a tune killed outright never says it is over)."""
    deadline = time.monotonic() + (ROUND_WAIT_S if wait_s is None else wait_s)
    told = False
    while time.monotonic() < deadline:
        attrs = study.user_attrs
        if int(attrs.get("trials") or 0) > budget:
            return int(attrs["trials"])
        if not attrs.get("searching"):
            return None
        if not told:
            say(f"worker: the study holds its {budget} trials; waiting for the tune's next round")
            told = True
        time.sleep(ROUND_POLL_S)
    say(f"worker: no new round in {ROUND_WAIT_S:.0f} s; stopping (the tune may have stopped without saying so)")
    return None


def load_space(study: optuna.Study) -> Space:
    space = Space(candidates=[])
    for entry in study.user_attrs["space"]:
        cand = Candidate.model_validate(entry["candidate"])
        space.candidates.append(cand)
        space.options[cand.id] = [tuple(Plan.model_validate({"actions": acts}).actions) for acts in entry["options"]]
    return space


def start(n: int, script: Path, args: list[str], options: TuneOptions, study_name: str, run_dir: Path,
          rounds: bool = False) -> list:
    """N worker processes on this host, each with its own run directory (logs, workspaces) and log file;
    `rounds`: each follows the tune's later rounds (else it stops once the study holds the current budget)."""
    procs = []
    url = storage_url(options, options.runs_root())
    for k in range(1, n + 1):
        folder = run_dir / "workers" / f"worker-{k}"
        folder.mkdir(parents=True, exist_ok=True)
        spec = {"script": str(Path(script).resolve()), "args": list(args), "run_dir": str(folder), "seed_offset": k,
                "rounds": rounds,
                "options": options.model_dump(mode="json") | {"storage": url, "join": study_name, "workers": 1}}
        log = open(folder / "worker.log", "w")
        proc = subprocess.Popen(WORKER_COMMAND, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                                text=True, cwd=Path.cwd())
        proc.stdin.write(json.dumps(spec))
        proc.stdin.close()
        log.close()
        procs.append((proc, folder / "worker.log"))
    return procs


class Crew:
    """This tune's other workers on this host (--workers N: N - 1 of them): started on entering; on leaving they
    are waited for (a line for each that did not end well), or stopped when the tune is (Ctrl-C, SIGTERM, a lost
    storage)."""

    def __init__(self, n: int, script: Path, args: list[str], run_dir: Path, options: TuneOptions, study_name: str,
                 say, rounds: bool = False) -> None:
        self.n, self.script, self.args, self.run_dir, self.rounds = n, script, args, run_dir, rounds
        self.options, self.study_name, self.say = options, study_name, say
        self.procs: list = []

    def __enter__(self) -> "Crew":
        if self.n > 0:
            self.procs = start(self.n, self.script, self.args, self.options, self.study_name, self.run_dir,
                               self.rounds)
            self.say(f"workers: this {'worker' if self.options.join else 'tune'} and {len(self.procs)} more on "
                     f"{socket.gethostname()} ({self.run_dir}/workers/)")
        return self

    def __exit__(self, kind, exc, tb) -> None:
        try:
            if kind is None:
                wait(self.procs, self.say)
        finally:
            stop(self.procs)


def wait(procs: list, say=None) -> list[str]:
    """Waits for the workers; a line for each that did not end well (its log's last line)."""
    lines = []
    for proc, log in procs:
        code = proc.wait()
        if code != 0:
            last = next((ln for ln in reversed(Path(log).read_text(errors="replace").splitlines()) if ln.strip()), "")
            lines.append(f"worker {log.parent.name} (pid {proc.pid}) exited {code}: {last[:200]} ({log})")
    for line in lines:
        (say or print)(line)
    return lines


def stop(procs: list) -> None:
    for proc, _ in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc, _ in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
