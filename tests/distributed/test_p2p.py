"""Point-to-point on tpu tensors (torch.distributed isend / irecv / batch_isend_irecv), world size 2 under torchrun,
against the same calls on CPU tensors over gloo in the same job: equal. Both ranks posting their send before their
receive (batch_isend_irecv's order) used to pair each rank's send with the other's send and receive zeros."""

from __future__ import annotations

import json
import textwrap

import pytest

from support.processes import clean_env, run_python

GLOO_TEARDOWN_ABORT = "terminate called without an active exception"

SCRIPT = textwrap.dedent("""
    import json
    import torch, torch.distributed as dist

    dist.init_process_group()
    rank = dist.get_rank()
    peer = 1 - rank
    out = {}
    for d in ("tpu", "cpu"):
        mine = torch.arange(6, dtype=torch.float32).reshape(2, 3).to(d) + 100 * rank
        got = torch.zeros(2, 3, device=d)
        # rank 0 sends first, rank 1 receives first
        works = [dist.isend(mine, peer), dist.irecv(got, peer)] if rank == 0 else \\
            [dist.irecv(got, peer), dist.isend(mine, peer)]
        for w in works:
            w.wait()
        # both ranks post their send first
        ops = [dist.P2POp(dist.isend, mine * 2, peer), dist.P2POp(dist.irecv, torch.zeros(2, 3, device=d), peer)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        # a send still posted when the sender's next collective comes; the receiver's recv blocks before its own
        ints, int_got = torch.full((4,), rank + 1, device=d, dtype=torch.int64), torch.zeros(4, dtype=torch.int64,
                                                                                              device=d)
        total = torch.ones(3, device=d) * (rank + 1)
        if rank == 0:
            w = dist.isend(ints, peer)
            mine.add_(1)  # after the send was posted: the receiver gets the value at isend
            dist.all_reduce(total)
            w.wait()
        else:
            dist.recv(int_got, peer)
            dist.all_reduce(total)
        out[d] = [got.cpu().tolist(), ops[1].tensor.cpu().tolist(), int_got.cpu().tolist(), total.cpu().tolist()]
    dist.barrier()
    dist.destroy_process_group()
    with open(f"rank{rank}.json", "w") as f:
        json.dump(out, f)
""")


@pytest.mark.slow  # one torchrun job of 2 ranks (about 15 s at normal load)
def test_isend_irecv_and_batch_isend_irecv_on_tpu_tensors_give_what_gloo_gives(tmp_path):
    (tmp_path / "script.py").write_text(SCRIPT)
    for _ in range(2):  # once more if gloo aborted at teardown
        proc = run_python("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "script.py",
                          cwd=tmp_path, env=clean_env(), timeout=200)
        if proc.returncode == 0 or GLOO_TEARDOWN_ABORT not in proc.stderr:
            break
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["tpu"] == result["cpu"], result
        other = 100.0 * (1 - rank)
        assert result["tpu"][1][0] == [2 * (other + v) for v in range(3)], result  # batch_isend_irecv's receive
    assert json.loads((tmp_path / "rank1.json").read_text())["tpu"][2] == [1, 1, 1, 1]
