"""`tpu-agent tune` end to end on small scripts: a search driven by Claude (a fake client) and verified, the same
study resumed with failing trials, bad input."""

from __future__ import annotations

import json
import sqlite3
import textwrap
from pathlib import Path

import pytest
from rich.console import Console

from support.claude import FakeClient, message, use
from support.processes import clean_env, run_tool
from tpu_agent import pipeline
from tpu_agent.config import TuneOptions
from tpu_agent.propose.claude import ClaudeProposer
from tpu_agent.report import markdown as report

pytestmark = pytest.mark.slow  # whole tunes or every example, end to end

TINY = textwrap.dedent("""
    import argparse
    import torch
    import torch.nn.functional as F

    BATCH = 31
    WIDTH = 63

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
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
""")


@pytest.fixture()
def project(tmp_path: Path) -> Path:
    (tmp_path / "tiny.py").write_text(TINY)
    return tmp_path


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

# A small MLP whose hidden width (a model size) is one off, for Claude's run: its plan must win by a margin CI's load
# cannot erase, since verification follows only a plan the search measured faster (a 3-layer MLP fused gained 1.25x
# here and measured 0.90x once in CI: no verification, the test failed; 10 layers compiled whole gain 2.7-3.0x,
# search CI low 1.5-1.7). Failure injection for the resumed search: with FAILS_COUNTER set, the profile run and the
# first baseline process run normally; every later process (the trials' candidates, in order) fails before its
# first step, each with the next failure of the comma-separated FAILS list, round and round (before the step: the
# candidate compiles nothing, so no step but the hung one comes near --trial-timeout).
MLP63 = textwrap.dedent("""\
    import argparse, os, time
    import torch
    import torch.nn.functional as F
    HIDDEN = 63
    counter = os.environ.get("FAILS_COUNTER")
    failure = None
    if counter:
        with open(counter, "a+") as f:
            f.seek(0)
            started = len(f.read().splitlines())
            f.write("x\\n")
        failures = os.environ.get("FAILS", "").split(",")
        failure = failures[(started - 2) % len(failures)] if started >= 2 else None
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    layers = [torch.nn.Linear(32, HIDDEN), torch.nn.ReLU()]
    for _ in range(8):
        layers += [torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(HIDDEN, 4)).to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(31, 32, generator=g).to("tpu")
    y = torch.randint(0, 4, (31,), generator=g).to("tpu")
    for step in range(args.steps):
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
        print(f"step={step} loss={loss.item():.6f}")
""")

PROPOSAL = {"proposals": [{
    "title": "Pad the hidden width and compile the whole step",
    "actions": [{"kind": "pad_dim", "knob": "mlp63.py:4:9", "choices": {"new": [64]}},
                {"kind": "compile", "choices": {"mode": ["compiled"]}}],
    "reason": "63 columns leave vector lanes empty; op-by-op dispatch of many small ops",
    "playbook": "pad-matmul-dims",
}]}


def test_a_claude_tune_is_verified_and_resumed_its_trials_repeat_nothing_failures_are_trials_and_other_settings_are_refused(
        tmp_path: Path, monkeypatch):
    """One study, two tunes. First a full tune driven by the Claude proposer with a fake client, in this process:
    its plan searched and verified in fresh processes, the report written, the key never written. Then the same
    study resumed to five trials by the command line (the offline proposer): its earlier trial listed and never
    repeated, and its candidates failing in turn: a crash, an out-of-memory error, a hang past --trial-timeout and a
    SIGKILL; each is a failed trial with its own reason, and the search goes on to the next (4 new trials, one per
    kind). Finished without --resume, and with other measuring settings, the study is refused. One study for what
    were two tests (Claude's tune, and a search of one trial resumed to five): Claude's tune is the earlier run the
    resume reads (a tune's start-up, baseline profile, warm baseline and trial fewer)."""
    key = "sk-ant-test-" + "x" * 24
    monkeypatch.setenv("ANTHROPIC_API_KEY", key)
    client = FakeClient([message([use("profile_summary", {}, "t1")]),
                         message([use("submit_proposals", PROPOSAL, "t2")])])

    def make_proposer(proposer, *, audit_dir, token_budget, source_root, **_model):
        return ClaudeProposer(client=client, audit_dir=audit_dir, token_budget=token_budget,
                              source_root=source_root, say=lambda _m: None)

    monkeypatch.setattr(pipeline, "make_proposer", make_proposer)
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "mlp63.py"
    script.write_text(MLP63)
    storage = f"sqlite:///{tmp_path / 'studies.db'}"
    # HIDDEN is the model's width (a model change): searched only with allow=model, so Claude is shown that knob
    # verify=1: Claude's best plan goes through a verification (what is checked), not the next two as well;
    # processes=1: that verification and each ablation unit in one fresh process pair (the interval's spread over
    # several pairs is not what is checked here: tests/measure/test_process_pairs.py)
    # trials=1: the one trial is the proposal's seed, Claude's plan itself (search/sampling.py's seeds), which the
    # verification needs; a second trial measured a plan of Claude's options too, checked by the same assertion
    settings = TuneOptions(trials=1, steps=5, pairs=5, warmup=2, storage=storage, study="s1", allow=["model"],
                           verify=1, processes=1)
    first = pipeline.run(script, [], settings, console=Console(quiet=True), proposer="claude",
                         runs_root=tmp_path / ".tpu-agent" / "runs")
    files = report.write_all(first, script)

    # Claude's tune: every change measured is Claude's, its plan verified, its class said, the key never written
    assert first.proposer == "claude"
    assert [c.proposer for c in first.candidates] == ["claude"]
    # Claude's plan went through the search to a verification in fresh processes. Whether it clears the bar is
    # timing on a shared 2-core machine (once 1.136x, CI 1.015-1.337: not accepted): not asserted here.
    assert first.verdicts and first.verdicts[0].speed is not None and first.verdicts[0].speed.pairs >= 5
    proposed = {("pad_dim", "HIDDEN", 64), ("compile", None, "compiled")}  # every change measured is Claude's
    measured = {(a.kind, getattr(a, "name", None), getattr(a, "new", getattr(a, "mode", None)))
                for plan in [*(t.plan for t in first.trials), *(v.plan for v in first.verdicts)] for a in plan.actions}
    assert measured and measured <= proposed, measured
    assert first.verdicts[0].plan.actions and first.verdicts[0].plan.effects()  # its class is said
    assert len(client.requests) == 2  # a tool-use turn, then the proposal
    for path in Path(first.run_dir).rglob("*"):
        if path.is_file():
            assert key.encode() not in path.read_bytes(), path
    # ... and its record and report
    assert len(first.trials) == 1
    assert all(t.state.value in {"complete", "numerics", "pruned", "repeated", "invalid", "failed"}
               for t in first.trials)
    report_md = files["report.md"].read_text()
    assert report_md.startswith("## tpu-agent: mlp63.py") and "claude" in report_md
    assert json.loads((Path(first.run_dir) / "report.json").read_text())["summary"]["kind"] == "summary"
    measured_plans = {json.dumps(t.plan.model_dump(mode="json"), sort_keys=True) for t in first.trials
                      if t.state.value == "complete"}

    # the command line from here on (the offline proposer: no key in its environment), with the study's settings
    base = ["tune", "mlp63.py", "--steps", "5", "--warmup", "2", "--allow", "model", "--pairs", "5", "--seed", "0",
            "--storage", storage, "--study", "s1", "--json"]
    again = run_tool(*base, "--trials", "1", cwd=tmp_path, env=clean_env())  # finished study, no --resume: refused
    assert again.returncode == 2 and "pass --resume" in again.stderr

    # the resumed search is what is checked here (--verify 0: search only). Its profile run and its first baseline
    # process run normally; every later process (the candidates, in order) fails before its first step, each with
    # the next failure of FAILURES; the hang's limit is --trial-timeout (not one of the study's measuring settings).
    # 8 s: the hung step waits it out, and every other step of the run must finish within it (the baseline's first
    # step, its compiles: 1.1-2.7 s at load 4-5; the profile's start-up and first step get twice it: about 5 s).
    env = clean_env(FAILS=",".join(FAILURES), FAILS_COUNTER=str(tmp_path / "counter"))
    proc = run_tool(*base, "--trials", "5", "--resume", "--verify", "0", "--trial-timeout", "8", cwd=tmp_path,
                    env=env, timeout=600)
    second = result_of(proc)
    # the one command that opens the study (tests/search/test_dashboard.py opens it), on stderr with --json
    assert f"live: optuna-dashboard {storage}" in proc.stderr
    assert "\x1b[" not in proc.stderr and "ETA" not in proc.stderr  # piped: plain lines, no progress bar
    resumed_report = (Path(second["run_dir"]) / "report.md").read_text()
    # a no-op the search left out (matmul precision default on a host already at it) is said and reported
    no_change = [line for line in proc.stderr.splitlines() if line.startswith("no change: ")]
    assert no_change and all(f"- {line}" in resumed_report for line in no_change), (proc.stderr[-2000:], resumed_report)
    assert [t["number"] for t in second["trials"]] == list(range(5)), [(t["number"], t["state"], t["reason"][:60]) for t in second["trials"]]  # the report lists the earlier trials too
    assert [t["earlier"] for t in second["trials"]] == [True] + [False] * 4
    new = [t for t in second["trials"] if not t["earlier"]]
    assert len(new) == 4  # 5 in all, 1 already done
    assert "(earlier run)" in resumed_report
    for t in new:
        if json.dumps(t["plan"], sort_keys=True) in measured_plans:
            assert t["state"] == "repeated", t  # a measured configuration is not run twice
    assert [n for n, _ in trials_in_db(tmp_path, "s1")] == list(range(5))
    assert not second["verdicts"] and second["best"] is None and second["phase"] == "done"
    ran = [t for t in new if t["state"] != "repeated"]  # a repeated plan starts no process
    assert len(ran) >= len(FAILURES), new
    for i, trial in enumerate(ran):  # the i-th candidate process got the i-th failure
        kind = FAILURES[list(FAILURES)[i % len(FAILURES)]]
        assert trial["state"] == "failed" and trial["reason"].startswith(kind), (i, kind, trial)

    # the same study name with other measuring settings: refused before any run, its trials untouched
    other = run_tool(*base, "--trials", "1", "--objective", "memory", "--resume", cwd=tmp_path, env=clean_env())
    assert other.returncode == 2 and "exists with different settings" in other.stderr
    assert [n for n, _ in trials_in_db(tmp_path, "s1")] == list(range(5))


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
