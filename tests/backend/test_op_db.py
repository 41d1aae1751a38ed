"""PyTorch's operator database on the tpu device: floors on fully passing ops, forward and gradients.

The check is split into interleaved shards (every SHARDS-th OpInfo), so that the suite's two workers share it
instead of one worker running it for minutes at the end. A shard's forward and gradient checks run in one worker
process (op_db_check.run), each OpInfo's forward check and then its gradients, so that the gradient check's forward
reuses the programs the forward check compiled; the process compiles with the suite's quick XLA flags
(tests/conftest.py: QUICK_COMPILE_FLAGS), which it inherits.
"""

from __future__ import annotations

import pytest

import op_db_check

# Regression floors, kept under the figures measured at 12 samples (98.1 % forward, 97.1 %
# gradients: `python tests/backend/op_db_check.py`); fewer samples per op keep the suite short
# and pass at least as often. Each shard is held to the floor on its own. The default pass checks each OpInfo's
# first sample, forward and gradients (the gradient check's forward runs the programs the forward check compiled);
# the release matrix (`-m matrix`, docs/ci.md) adds each OpInfo's second forward sample (another shape, often other
# arguments), about a third of the check's time.
FORWARD_FLOOR = 0.96
GRAD_FLOOR = 0.94
FORWARD_SAMPLES = 1
MATRIX_FORWARD_SAMPLES = 2
GRAD_SAMPLES = 1
SHARDS = 2


# part: (floor, fewest OpInfos a shard tests, what a shortfall says)
PARTS = {
    "forward": (FORWARD_FLOOR, 500 // SHARDS, "op_db shrank: is the harness still reading PyTorch's op_db?"),
    "gradients": (GRAD_FLOOR, 400 // SHARDS,
                  "fewer OpInfos with gradients than expected: is the gradient worker running?"),
}


@pytest.mark.parametrize("shard, forward_samples", [
    *(pytest.param(k, FORWARD_SAMPLES, id=f"shard{k}of{SHARDS}") for k in range(SHARDS)),
    *(pytest.param(k, MATRIX_FORWARD_SAMPLES, id=f"shard{k}of{SHARDS}-{MATRIX_FORWARD_SAMPLES}-samples",
                   marks=pytest.mark.matrix) for k in range(SHARDS))])
def test_op_db_float32_floor(shard: int, forward_samples: int):
    """Every OpInfo of the shard: forward (`forward_samples` samples each) and gradients (GRAD_SAMPLES), each part
    held to its floor and to the number of OpInfos it must have tested."""
    summary = op_db_check.run(max_samples=forward_samples, grad_samples=GRAD_SAMPLES, shard=(shard, SHARDS))
    for part, (floor, fewest, shrank) in PARTS.items():
        results = summary.results if part == "forward" else summary.grad_results
        tested = [r for r in results if r.samples or r.error]
        assert len(tested) > fewest, shrank
        rate = summary.pass_rate if part == "forward" else summary.grad_pass_rate
        print(op_db_check.report(part, results))
        assert rate >= floor, f"{part} {rate:.1%} < {floor:.0%}; failing: {sorted(r.name for r in tested if not r.ok)}"


# The OpInfos whose CPU run writes into a tensor argument (found by running every float32 sample of op_db on the
# CPU; the random in-place ops, cauchy_ and the like, are compared by shape only). The outputs-only check let batch
# norm drop its running statistics on tpu; every argument is now compared after the call.
WRITERS = ["native_batch_norm", "_native_batch_norm_legit", "_batch_norm_with_update", "nn.functional.batch_norm",
           "nn.functional.instance_norm", "nn.functional.embedding", "nn.functional.embedding_bag"]


def test_ops_that_write_their_arguments_write_what_the_cpu_writes():
    from torch.testing._internal.common_methods_invocations import op_db

    infos = [o for o in op_db if op_db_check._name(o) in WRITERS]
    assert sorted({op_db_check._name(o) for o in infos}) == sorted(WRITERS), "op_db renamed one of these OpInfos"
    results = [op_db_check.check_op(o) for o in infos]
    for r in results:
        assert r.writes > 0, f"{r.name}: no sample wrote into an argument on the CPU: this check would say nothing"
        assert r.write_errors == 0, f"{r.name}: {r.write_errors} of {r.samples} samples wrote otherwise on tpu: {r.error}"
