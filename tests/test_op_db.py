"""PyTorch's operator database on the tpu device: floors on fully passing ops, forward and gradients."""

from __future__ import annotations

import op_db_check

# Regression floors, kept just under the figures measured at these sample counts (see the
# README of op_db_check's output: `python tests/op_db_check.py` uses 12 samples for both).
FORWARD_FLOOR = 0.85
GRAD_FLOOR = 0.85
FORWARD_SAMPLES = 6  # the README's figures use 12; fewer keep CI short
GRAD_SAMPLES = 3


def test_op_db_float32_forward_and_gradient_floors():
    summary = op_db_check.run(max_samples=FORWARD_SAMPLES, grad_samples=GRAD_SAMPLES)
    tested, grad_tested = summary.tested, summary.grad_tested
    assert len(tested) > 500, "op_db shrank: is the harness still reading PyTorch's op_db?"
    assert len(grad_tested) > 400, "fewer OpInfos with gradients than expected: is the gradient worker running?"
    failures = sorted(r.name for r in tested if not r.ok)
    grad_failures = sorted(r.name for r in grad_tested if not r.ok)
    print(op_db_check.report("forward", summary.results))
    print(op_db_check.report("gradients", summary.grad_results))
    assert summary.pass_rate >= FORWARD_FLOOR, f"forward {summary.pass_rate:.1%} < {FORWARD_FLOOR:.0%}; failing: {failures}"
    assert summary.grad_pass_rate >= GRAD_FLOOR, (
        f"gradients {summary.grad_pass_rate:.1%} < {GRAD_FLOOR:.0%}; failing: {grad_failures}"
    )
