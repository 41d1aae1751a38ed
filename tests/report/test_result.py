"""tune.json's summary after a verified change: every field keeps its declared type."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

from support.paths import DATA
from tpu_agent.profilers.schema import Profile
from tpu_agent.report.result import summary_of


def test_a_verified_memory_median_is_a_whole_number_of_bytes_and_dumps_without_a_warning():
    profile = Profile.model_validate_json((DATA / "profile_odd_mlp.json").read_text())
    verdict = SimpleNamespace(speed=SimpleNamespace(per_sample=False, candidate_median_s=0.01, pairs=20),
                              memory=SimpleNamespace(candidate_median_bytes=67584.0))  # a median of byte counts
    summary = summary_of(profile, verdict)
    assert summary.live_peak_bytes == 67584 and isinstance(summary.live_peak_bytes, int)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # pydantic's serializer warning leaked into the tune's output
        summary.model_dump_json()
