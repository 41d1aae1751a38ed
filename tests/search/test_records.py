"""A trial's record apart from Optuna: each state says once what the proposers read of it."""

from __future__ import annotations

import subprocess
import sys
from typing import get_args

from tpu_agent.plan.actions import Compile, Plan
from tpu_agent.propose.base import OutcomeStatus
from tpu_agent.search.records import TrialRecord, TrialState


def test_every_state_maps_to_a_proposer_status():
    assert {s.status for s in TrialState} <= set(get_args(OutcomeStatus))
    assert {s: s.status for s in TrialState} == {
        "complete": "measured", "numerics": "rejected", "repeated": "measured", "failed": "failed",
        "pruned": "pruned", "invalid": "invalid"}


def test_a_record_reads_as_the_proposers_outcome_and_round_trips_as_json():
    record = TrialRecord(number=3, plan=Plan(actions=[Compile(mode="fused")]), state="numerics", speedup=1.2,
                         reason="losses off")
    outcome = record.outcome()
    assert (outcome.status, outcome.loss_ok, outcome.speedup, outcome.note) == ("rejected", False, 1.2, "losses off")
    assert outcome.actions == [Compile(mode="fused")]  # the Action models themselves, not dicts
    assert '"state":"numerics"' in record.model_dump_json()
    assert TrialRecord.model_validate_json(record.model_dump_json()) == record


def test_the_report_reads_records_without_loading_optuna():
    code = ("import sys, tpu_agent.search.records, tpu_agent.report.result, tpu_agent.report.markdown; "
            "print('optuna' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
