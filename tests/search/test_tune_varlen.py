"""The tuner on a script whose batches take their own longest length: the recompilation diagnosed, bucketing
verified as exact."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from support.paths import EXAMPLES
from support.processes import clean_env, run_tool
from tpu_agent.profilers.schema import Profile

pytestmark = pytest.mark.slow  # a whole tune, end to end


def small_varlen(project: Path) -> Path:
    """examples/varlen_lm.py with a smaller model and batches of 2 (the longest of two sentences of 8-128 tokens:
    a new length almost every step, through the verification's 6 steps too): the same collate, the same loop."""
    source = (EXAMPLES / "varlen_lm.py").read_text()
    for name, value in {"N_LAYERS": 1, "D_MODEL": 32, "VOCAB": 128, "MAX_LEN": 128, "BATCH": 2}.items():
        source, n = re.subn(rf"^{name} = \d+$", f"{name} = {value}", source, flags=re.M)
        assert n == 1, name
    script = project / "varlen.py"
    script.write_text(source)
    return script


def test_a_variable_length_lm_is_diagnosed_and_its_batches_padded_to_a_fixed_length_verified_exact(tmp_path):
    small_varlen(tmp_path)
    # --processes 1: one fresh process pair verifies (5 pairs, compiles included); the interval over several
    # process pairs is checked by tests/measure/test_process_pairs.py and tests/verify/test_tune_ablation.py
    proc = run_tool("tune", "varlen.py", "--trials", "1", "--candidates", "1", "--verify", "1", "--steps", "5",
                    "--pairs", "5", "--warmup", "1", "--processes", "1", "--", "--steps", "40", cwd=tmp_path,
                    env=clean_env(), timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (run_dir,) = (tmp_path / ".tpu-agent" / "runs").iterdir()
    tune = json.loads((run_dir / "tune.json").read_text())

    # the diagnosis, in the baseline's profile
    profile = Profile.model_validate_json(Path(tune["baseline_profile"]).read_text())
    rec = profile.recompiling
    assert rec is not None and rec.verdict.startswith("recompiling: ") and "of dim 1 of the batch's" in rec.verdict
    assert rec.compile_share > 0.3 and rec.compiling_steps >= 3
    dims = {d.tensor: d for d in rec.batch_dims}
    assert (dims["['input_ids']"].pad_value, dims["['input_ids']"].pad_value_seen) == (0.0, True)
    assert (dims["['labels']"].pad_value, dims["['labels']"].pad_value_seen) == (-100.0, True)
    assert "collate: collate at varlen.py:46" in rec.sources
    assert any("pad_sequence(batch, batch_first=True, padding_value=-100)" in s for s in rec.sources)
    sizes = set(dims["['input_ids']"].sizes)
    assert profile.padding.varying_left_out and not sizes & {d.size for d in profile.padding.dims}

    # the fix: the batches padded where they leave the loader, verified with a gain, exact by its losses
    best = tune["best"]
    assert best is not None and best["accepted"], tune["verdicts"]
    (action,) = best["plan"]["actions"]
    assert action["kind"] == "pad_batch" and action["effect"] == "exact" and action["dim"] == 1
    assert action["values"] == {"['input_ids']": 0.0, "['labels']": -100.0}
    assert action["buckets"][-1] % 8 == 0 and action["buckets"][-1] >= max(sizes)
    assert best["numerics"]["kind"] == "exact" and best["numerics"]["passed"]
    assert best["speed"]["ci_low"] > 1.03 and "compiles included" in best["reason"]
    assert set(tune["phase_s"]) >= {"baseline", "search", "verification", "profile"}
    report = (run_dir / "report.md").read_text()
    assert "batch dim 1 padded to" in report and "exact" in report
