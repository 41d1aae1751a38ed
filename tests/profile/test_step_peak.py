"""The in-step peak (backend/core/memory.py's StepPeak): the most device bytes alive inside a step, which bytes alive at
the step boundaries miss. Per rank in `profile --nproc 2`: FSDP2's reshard_after_forward=False raises it (the
gathered parameters are kept from forward to backward) and activation checkpointing lowers it, while the bytes
alive at the step boundary stay the same (issue #26 point 5)."""

from __future__ import annotations

import json
import textwrap

import pytest

from support.processes import run_tool


def test_a_buffer_made_and_freed_inside_a_step_is_in_its_peak_not_at_its_boundary():
    import torch

    import tpu_agent.backend  # noqa: F401 - the tpu device
    from tpu_agent.backend.core import memory
    from tpu_agent.backend.core.state import STATE

    was = STATE.memory_watch
    STATE.set_memory_watch(None)
    try:
        watch = memory.watch_step_peaks()
        assert memory.watch_step_peaks() is watch  # one watcher per process
        x = torch.ones(256, 256, device="tpu")  # 256 KiB
        watch.end_step()
        big = x.repeat(8, 1)  # 2 MiB, and 2 MiB more for its double: both alive at once, gone by the boundary
        (big * 2).sum().item()
        del big
        peak, after = watch.end_step(), watch.current
        assert peak - after >= 4 * 2**20
        watch.end_step()
        (x + 1).sum().item()  # a step without the big buffers: their bytes are not carried over
        assert watch.end_step() - watch.current < 2**20
    finally:
        STATE.set_memory_watch(was)


# Three variants of one FSDP2 model, two steps each (a second step reads as the first: 3 gave the same figures
# at every step, 2026-12-08), in one job: reshard after forward (FSDP2's default), kept unsharded from forward to
# backward, and resharded with every block checkpointed. BATCH is large enough that the saved activations (3 blocks
# x 256 x 320 float32, ~1 MiB) outweigh the parameters (~200 KiB unsharded).
SCRIPT = textwrap.dedent("""
    import gc
    import torch, torch.distributed as dist, torch.nn as nn, torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard
    from torch.utils.checkpoint import checkpoint

    class Block(nn.Module):
        def __init__(self, ckpt):
            super().__init__()
            self.ckpt = ckpt
            self.norm, self.up, self.down = nn.LayerNorm(64), nn.Linear(64, 128), nn.Linear(128, 64)
        def body(self, x):
            return x + self.down(F.gelu(self.up(self.norm(x))))
        def forward(self, x):
            return checkpoint(self.body, x, use_reentrant=False) if self.ckpt else self.body(x)

    dist.init_process_group()
    for reshard, ckpt in ((True, False), (False, False), (True, True)):
        torch.manual_seed(0)
        model = nn.Sequential(*[Block(ckpt) for _ in range(3)], nn.Linear(64, 8)).to("tpu")
        for block in list(model)[:3]:
            fully_shard(block, reshard_after_forward=reshard)
        fully_shard(model, reshard_after_forward=reshard)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(2):
            x = torch.randn(256, 64).to("tpu")
            F.cross_entropy(model(x), torch.zeros(256, dtype=torch.long, device="tpu")).backward()
            opt.step()
            opt.zero_grad()
        del model, opt
        gc.collect()
""")


@pytest.mark.slow  # one 2-rank profile
def test_reshard_after_forward_and_checkpointing_change_each_ranks_in_step_peak(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    proc = run_tool("profile", "--nproc", "2", "--mode", "eager", "--warmup", "1", "--host-device-steps", "0",
                    "--no-dump-hlo", "-o", "out", "train.py", cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "out").iterdir()
    ranks = json.loads((run_dir / "profile.json").read_text())["distributed"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    for entry in ranks:
        steps = json.loads((tmp_path / entry["profile"]).read_text())["steps"]["items"]
        assert len(steps) == 6
        # Each variant's last step (its optimizer state made), by what it holds above the step's boundary: the
        # bytes alive there differ between variants (the first model's are not all freed when the second starts).
        resharded, kept, checkpointed = steps[1], steps[3], steps[5]
        rise = {k: s["peak_bytes"] - s["live_bytes"] for k, s in (("resharded", resharded), ("kept", kept),
                                                                    ("checkpointed", checkpointed))}
        shown = (entry["rank"], [(s["live_bytes"], s["peak_bytes"]) for s in steps])
        assert rise["kept"] > rise["resharded"] + 64 * 1024, shown  # blocks kept gathered (109 KiB more, 2026-12-05)
        assert rise["checkpointed"] < rise["resharded"] - 256 * 1024, shown  # activations not kept (758 KiB less)
        assert kept["live_bytes"] == checkpointed["live_bytes"], shown  # the boundary sees neither
        assert entry["step_peak_bytes"] >= kept["peak_bytes"] > entry["live_peak_bytes"]
    assert "in-step peak" in proc.stdout  # the ranks table's column
