"""optuna-dashboard opens a study our search wrote, through the command `tune` prints, and finds the trials with
their attributes (its WSGI app called in process: no port, no browser)."""

from __future__ import annotations

import io
import json
import shlex
import sys

import pytest

from support.search_table import FAST, OOM, ROUNDS, run, space
from tpu_agent.measure.stats import speedup
from tpu_agent.search.study import dashboard_command, note_verdicts
from tpu_agent.verify.verdict import Verdict

optuna_dashboard = pytest.importorskip("optuna_dashboard")  # the test extra installs it (scripts/setup.sh)


def get(app, path: str) -> dict:
    """One GET to the dashboard's API, as its web page asks."""
    status = []
    environ = {"REQUEST_METHOD": "GET", "PATH_INFO": path, "QUERY_STRING": "", "SERVER_NAME": "localhost",
               "SERVER_PORT": "8080", "wsgi.url_scheme": "http", "wsgi.input": io.BytesIO(), "wsgi.errors": sys.stderr}
    body = b"".join(app(environ, lambda s, headers, exc_info=None: status.append(s)))
    assert status[0].startswith("200"), (status, body[:300])
    return json.loads(body)


def attrs(item: dict) -> dict:
    return {a["key"]: a["value"] for a in item["user_attrs"]}


def test_the_dashboard_opens_the_printed_storage_and_shows_trials_with_their_attributes(tmp_path):
    study, records, _ = run(tmp_path, space(FAST, ROUNDS, OOM), [FAST, ROUNDS, OOM])
    estimate = speedup([0.010] * 10, [0.008, 0.0081, 0.0079] * 3 + [0.008])
    note_verdicts(study, [Verdict(plan=records[0].plan, accepted=True, reason="verified", speed=estimate)],
                  Verdict(plan=records[0].plan, accepted=True, reason="verified", speed=estimate))

    command = shlex.split(dashboard_command(f"sqlite:///{tmp_path / 'studies.db'}"))
    assert command[0] == "optuna-dashboard"
    app = optuna_dashboard.wsgi(command[1])
    (listed,) = get(app, "/api/studies")["study_summaries"]
    assert listed["study_name"] == study.study_name
    detail = get(app, f"/api/studies/{listed['study_id']}")

    shown = attrs(detail)
    verified = json.loads(shown["verified"])
    assert verified["plan"] == records[0].plan.describe() and verified["speedup"] == pytest.approx(1.25, rel=0.02)
    low, high = verified["ci95"]
    assert low <= verified["speedup"] <= high and shown["pruner"] == "median" and shown["script"] == "train.py"

    trials = detail["trials"]
    assert [t["state"] for t in trials] == ["Complete"] * 3
    fast, rounds, oom = (attrs(t) for t in trials)
    assert fast["description"] == records[0].plan.describe() and float(fast["speedup"]) == pytest.approx(1.25, rel=0.05)
    assert len(json.loads(fast["speedup_ci95"])) == 2 and fast["feasible"] == "True"
    assert json.loads(fast["class"]) == ["numerics"] and verified["class"] == ["numerics"]  # fused execution
    assert rounds["state"] == "numerics" and rounds["feasible"] == "False" and "numerics" in json.loads(rounds["constraints"])
    assert oom["state"] == "failed" and json.loads(oom["constraints"]) == {"out_of_memory": 1.0}
    assert len(trials[0]["intermediate_values"]) == 8  # one per pair: the dashboard's intermediate-value plot
    assert [t["number"] for t in detail["best_trials"]] == [0]  # the failed-numerics trial measured faster
