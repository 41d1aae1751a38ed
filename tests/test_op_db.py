"""PyTorch's operator database on the tpu device: a floor on fully passing ops."""

from __future__ import annotations

import op_db_check

FLOOR = 0.85  # the issue asks for 60 %; measured 91 %: a regression floor


def test_op_db_float32_forward_floor():
    summary = op_db_check.run(max_samples=6)  # the README's figure uses 12; 6 keeps CI short
    tested = summary.tested
    assert len(tested) > 500, "op_db shrank: is the harness still reading PyTorch's op_db?"
    failures = sorted(r.name for r in tested if not r.ok)
    print(f"op_db float32 forward: {len(tested) - len(failures)}/{len(tested)} fully pass ({summary.pass_rate:.1%})")
    assert summary.pass_rate >= FLOOR, f"{summary.pass_rate:.1%} < {FLOOR:.0%}; failing: {failures}"
