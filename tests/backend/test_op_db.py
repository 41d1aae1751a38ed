"""PyTorch's operator database on the tpu device: floors on fully passing ops, forward and gradients.

The check is split into interleaved shards (every SHARDS-th OpInfo), forward and gradients apart, so that the
suite's two workers share it instead of one worker running it for minutes at the end; each part runs in a
process of its own whose XLA compiles without LLVM's optimisations (op_db_check.QUICK_COMPILE_FLAGS: the same
arithmetic, compiled 2-3x faster).
"""

from __future__ import annotations

import pytest

import op_db_check

# Regression floors, kept under the figures measured at 12 samples (98.1 % forward, 97.1 %
# gradients: `python tests/backend/op_db_check.py`); fewer samples per op keep the suite short
# and pass at least as often. Each shard is held to the floor on its own.
FORWARD_FLOOR = 0.96
GRAD_FLOOR = 0.94
FORWARD_SAMPLES = 2
GRAD_SAMPLES = 1
SHARDS = 2


@pytest.mark.parametrize("shard", range(SHARDS), ids=lambda k: f"shard{k}of{SHARDS}")
def test_op_db_float32_forward_floor(shard: int):
    summary = op_db_check.run_in_subprocess("forward", FORWARD_SAMPLES, (shard, SHARDS))
    tested = summary.tested
    assert len(tested) > 500 // SHARDS, "op_db shrank: is the harness still reading PyTorch's op_db?"
    failures = sorted(r.name for r in tested if not r.ok)
    print(op_db_check.report("forward", summary.results))
    assert summary.pass_rate >= FORWARD_FLOOR, f"forward {summary.pass_rate:.1%} < {FORWARD_FLOOR:.0%}; failing: {failures}"


@pytest.mark.parametrize("shard", range(SHARDS), ids=lambda k: f"shard{k}of{SHARDS}")
def test_op_db_float32_gradient_floor(shard: int):
    summary = op_db_check.run_in_subprocess("gradients", GRAD_SAMPLES, (shard, SHARDS))
    grad_tested = summary.grad_tested
    assert len(grad_tested) > 400 // SHARDS, "fewer OpInfos with gradients than expected: is the gradient worker running?"
    grad_failures = sorted(r.name for r in grad_tested if not r.ok)
    print(op_db_check.report("gradients", summary.grad_results))
    assert summary.grad_pass_rate >= GRAD_FLOOR, (
        f"gradients {summary.grad_pass_rate:.1%} < {GRAD_FLOOR:.0%}; failing: {grad_failures}")
