"""The executables API the profiler reads: names, HLO, cost and memory analysis, counts."""

from __future__ import annotations

import torch

from tpu_agent.backend.core import executables


def _new_since(before: set[int]):
    return [e for e in executables.all() if e.id not in before]


def test_eager_matmul_flops_and_counts():
    before = {e.id for e in executables.all()}
    a = torch.randn(64, 128).to("tpu")
    b = torch.randn(128, 32).to("tpu")
    for _ in range(3):
        (a @ b).sum().item()
    mm = [e for e in _new_since(before) if e.name == "aten.mm.default"]
    assert len(mm) == 1
    exe = mm[0]
    assert exe.kind == "eager" and exe.calls == 3
    assert exe.cost()["flops"] == 2 * 64 * 128 * 32
    assert exe.cost()["bytes_accessed"] >= 4 * (64 * 128 + 128 * 32 + 64 * 32)
    memory = exe.memory()
    assert memory["argument_bytes"] == 4 * (64 * 128 + 128 * 32)
    assert memory["output_bytes"] == 4 * 64 * 32
    assert "dot(" in exe.hlo_text()
    assert exe.source and exe.source.startswith("test_executables.py:")


def test_fused_graph_is_one_executable_with_op_names_in_its_hlo():
    before = {e.id for e in executables.all()}
    a = torch.randn(16, 32).to("tpu")
    w = torch.randn(32, 8).to("tpu")
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
        out = torch.tanh(a @ w).sum()
        out.item()
    fused = [e for e in _new_since(before) if e.kind == "fused"]
    assert len(fused) == 1 and fused[0].calls == 1
    assert "aten.mm.default" in fused[0].ops and "aten.tanh.default" in fused[0].ops
    hlo = fused[0].hlo_text()
    assert "aten.mm.default" in hlo  # op names reach HLO metadata
    assert fused[0].cost()["flops"] >= 2 * 16 * 32 * 8


def test_snapshot_and_reset_counts():
    x = torch.ones(4).to("tpu")
    (x + 1).sum().item()
    snap = executables.snapshot()
    (x + 1).sum().item()
    after = executables.snapshot()
    changed = [i for i in after if after[i][0] != snap.get(i, (0, 0))[0]]
    assert changed
    executables.reset_counts()
    assert all(e.calls == 0 for e in executables.all())
