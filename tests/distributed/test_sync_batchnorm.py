"""SyncBatchNorm under DDP at world size 2 on tpu (`tpu-agent run --nproc 2`): batch statistics over both ranks'
batches (PyTorch's batch_norm_stats, an all-gather, batch_norm_gather_stats_with_counts, batch_norm_elemt; the
backward's batch_norm_backward_reduce, all-reduce, batch_norm_backward_elemt), running statistics updated with
them (momentum, and momentum=None's cumulative average), and each rank's losses, buffers and evaluation logits
as the CPU computes them. PyTorch has no SyncBatchNorm on the CPU: the reference is plain BatchNorm over the
ranks' batches concatenated, in one process (tests/data/scripts/sync_bn.py's `reference`)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from support.paths import DATA
from support.processes import clean_env, run_tool

SCRIPT = DATA / "scripts" / "sync_bn.py"


def _reference() -> dict:
    spec = importlib.util.spec_from_file_location("sync_bn", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.reference(world=2, steps=4)


@pytest.mark.slow  # one 2-rank job (about 70 s on a loaded 2-core host)
def test_sync_batchnorm_across_two_ranks_matches_batchnorm_over_the_whole_batch(tmp_path):
    proc = run_tool("run", "--nproc", "2", str(SCRIPT), "--", "--out", str(tmp_path), cwd=tmp_path,
                    env=clean_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ref = _reference()
    for rank in (0, 1):
        run = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert run["sync"] == "SyncBatchNorm"
        assert run["losses"] == pytest.approx(ref["losses"][rank], rel=1e-5), rank
        assert run["buffers"].keys() == ref["buffers"].keys()
        for name, values in ref["buffers"].items():
            assert run["buffers"][name] == pytest.approx(values, rel=1e-5, abs=1e-6), (rank, name)
        assert run["logits"] == pytest.approx(ref["logits"], rel=1e-5, abs=1e-6), rank
    # The running statistics moved, over both ranks' batches (one rank's alone would give other values).
    assert ref["buffers"]["bn.num_batches_tracked"] == [4] and any(v != 0 for v in ref["buffers"]["bn.running_mean"])
    assert ref["losses"][0] != ref["losses"][1]
