"""`tpu-agent tune` end to end on a tiny script: search, failures, resume, bad input."""

from __future__ import annotations

import json
import sqlite3
import textwrap
from pathlib import Path

import pytest

from support.processes import clean_env, run_tool

pytestmark = pytest.mark.slow  # whole tunes or every example, end to end

TINY = textwrap.dedent("""
    import argparse, os, sys, time
    import torch
    import torch.nn.functional as F

    BATCH = 31
    WIDTH = 63

    # Failure injection for the tests: the profile run and the first baseline process run
    # normally; every later process (the trials' candidates, in order) fails at step 3, each with
    # the next failure of the comma-separated TINY_FAIL list, round and round.
    counter = os.environ.get("TINY_COUNTER")
    late, failure = False, None
    if counter:
        with open(counter, "a+") as f:
            f.seek(0)
            started = len(f.read().splitlines())
            f.write("x\\n")
        failures = os.environ.get("TINY_FAIL", "").split(",")
        late = started >= 2
        failure = failures[(started - 2) % len(failures)] if late else None

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, 4)).to("tpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, WIDTH, generator=g).to("tpu")
    y = torch.randint(0, 4, (BATCH,), generator=g).to("tpu")
    for step in range(args.steps):
        if late and step == 3:
            if failure == "crash":
                raise RuntimeError("boom in the candidate")
            if failure == "hang":
                time.sleep(3600)
            if failure == "kill":  # as `kill -9` of the trial process would
                os.kill(os.getpid(), 9)
            if failure == "oom":
                raise MemoryError("RESOURCE_EXHAUSTED: out of memory allocating 1 TiB")
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
""")


@pytest.fixture()
def project(tmp_path: Path) -> Path:
    (tmp_path / "tiny.py").write_text(TINY)
    return tmp_path


def tune(project: Path, *args: str, env: dict | None = None, timeout: float = 600):
    base = ["tune", "tiny.py", "--steps", "5", "--warmup", "1", "--pairs", "5", "--seed", "0",
            "--storage", f"sqlite:///{project / 'studies.db'}", "--json"]
    return run_tool(*base, *args, cwd=project, env=clean_env(**(env or {})), timeout=timeout)


def trials_in_db(project: Path, study: str) -> list[tuple[int, str]]:
    con = sqlite3.connect(project / "studies.db")
    rows = con.execute(
        "select t.number, t.state from trials t join studies s on s.study_id = t.study_id "
        "where s.study_name = ? order by t.number", (study,)).fetchall()
    con.close()
    return rows


def result_of(proc) -> dict:
    assert proc.returncode in (0, 130), proc.stderr[-3000:]
    return json.loads(proc.stdout)["result"]


FAILURES = {"crash": "crashed", "oom": "out_of_memory", "hang": "timed_out",
            "kill": "crashed: the process was killed by SIGKILL"}


def test_tune_records_trials_writes_a_report_resume_repeats_nothing_failures_are_trials_and_other_settings_are_refused(
        project: Path):
    """One trial, then the same study resumed to five: each step of the resume is checked with one earlier trial as
    well as with more, in less of the suite's time (a trial here starts its own processes: about 15 s on a quiet host).
    The resumed run's candidates fail in turn: a crash, an out-of-memory error, a hang past --trial-timeout and a
    SIGKILL; each is a failed trial with its own reason, and the search goes on to the next (4 new trials, one per
    kind: the sampler never proposes a measured plan again). One study for both, so that the resume's baseline
    profile and warm baseline serve the failures too (a tune's start-up fewer)."""
    # --verify 0: search only. What is checked here is the search's record, the report and the resume; a tune's
    # verification end to end: tests/search/test_tune_varlen.py (accepted, exact), tests/search/test_tune_claude.py
    # and tests/verify/test_tune_ablation.py (its interval over process pairs: tests/measure/test_process_pairs.py)
    proc = tune(project, "--trials", "1", "--study", "s1", "--verify", "0")
    first = result_of(proc)
    # the one command that opens the study (tests/search/test_dashboard.py opens it), on stderr with --json
    assert f"live: optuna-dashboard sqlite:///{project / 'studies.db'}" in proc.stderr
    assert "\x1b[" not in proc.stderr and "ETA" not in proc.stderr  # piped: plain lines, no progress bar
    assert len(first["trials"]) == 1
    assert all(t["state"] in {"complete", "numerics", "pruned", "repeated", "invalid", "failed"} for t in first["trials"])
    run_dir = Path(first["run_dir"])
    report = (run_dir / "report.md").read_text()
    assert report.startswith("## tpu-agent: tiny.py")
    # a no-op the search left out (matmul precision default on a host already at it) is said and reported
    no_change = [line for line in proc.stderr.splitlines() if line.startswith("no change: ")]
    assert no_change and all(f"- {line}" in report for line in no_change), (proc.stderr[-2000:], report)
    assert json.loads((run_dir / "report.json").read_text())["summary"]["kind"] == "summary"
    measured_plans = {json.dumps(t["plan"], sort_keys=True) for t in first["trials"] if t["state"] == "complete"}

    again = tune(project, "--trials", "1", "--study", "s1")  # finished study, no --resume: refused
    assert again.returncode == 2 and "pass --resume" in again.stderr

    # the resumed search is what is checked here (--verify 0: search only). Its profile run
    # and its first baseline process run normally; every later process (the candidates, in order) fails at step 3,
    # each with the next failure of FAILURES (tiny.py's TINY_FAIL); the hang's limit is --trial-timeout (not one of
    # the study's measuring settings). 8 s: the hung step waits it out, and every other step of the run must finish
    # within it (a candidate's first step, its compiles: 1.1-2.7 s at load 4-5; the profile's start-up and first
    # step get twice it: about 5 s); 15 s cost 7 s more for no more checked.
    env = {"TINY_FAIL": ",".join(FAILURES), "TINY_COUNTER": str(project / "counter")}
    second = result_of(tune(project, "--trials", "5", "--study", "s1", "--resume", "--verify", "0",
                            "--trial-timeout", "8", env=env))
    assert [t["number"] for t in second["trials"]] == list(range(5)), [(t["number"], t["state"], t["reason"][:60]) for t in second["trials"]]  # the report lists the earlier trials too
    assert [t["earlier"] for t in second["trials"]] == [True] + [False] * 4
    new = [t for t in second["trials"] if not t["earlier"]]
    assert len(new) == 4  # 5 in all, 1 already done
    assert "(earlier run)" in (Path(second["run_dir"]) / "report.md").read_text()
    for t in new:
        if json.dumps(t["plan"], sort_keys=True) in measured_plans:
            assert t["state"] == "repeated", t  # a measured configuration is not run twice
    assert [n for n, _ in trials_in_db(project, "s1")] == list(range(5))
    assert not second["verdicts"] and second["best"] is None and second["phase"] == "done"
    ran = [t for t in new if t["state"] != "repeated"]  # a repeated plan starts no process
    assert len(ran) >= len(FAILURES), new
    for i, trial in enumerate(ran):  # the i-th candidate process got the i-th failure
        kind = FAILURES[list(FAILURES)[i % len(FAILURES)]]
        assert trial["state"] == "failed" and trial["reason"].startswith(kind), (i, kind, trial)

    # the same study name with other measuring settings: refused before any run, its trials untouched
    other = tune(project, "--trials", "1", "--study", "s1", "--objective", "memory", "--resume")
    assert other.returncode == 2 and "exists with different settings" in other.stderr
    assert [n for n, _ in trials_in_db(project, "s1")] == list(range(5))


def test_bad_inputs_are_one_line_and_exit_2(project: Path):
    bad_storage = run_tool("tune", "tiny.py", "--storage", "postgresql://nobody@127.0.0.1:1/none", cwd=project,
                           env=clean_env(), timeout=120)
    assert bad_storage.returncode == 2 and bad_storage.stderr.startswith("error: cannot open the study storage")
    assert len(bad_storage.stderr.strip().splitlines()) == 1

    (project / "plan.json").write_text(json.dumps({"actions": [{"kind": "pad_ops", "multiple": 1}]}))
    bad_plan = run_tool("run", "tiny.py", "--plan", "plan.json", cwd=project, env=clean_env())
    assert bad_plan.returncode == 2 and "invalid plan plan.json: actions.0.pad_ops.multiple" in bad_plan.stderr

    stale = {"actions": [{"kind": "pad_dim", "file": "tiny.py", "line": 6, "column": 8, "old": 32, "new": 64}]}
    (project / "plan.json").write_text(json.dumps(stale))
    moved = run_tool("run", "tiny.py", "--plan", "plan.json", cwd=project, env=clean_env())
    assert moved.returncode == 2 and "the source has 31" in moved.stderr and len(moved.stderr.strip().splitlines()) == 1
