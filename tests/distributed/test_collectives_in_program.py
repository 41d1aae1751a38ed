"""Collectives inside fused mode's graph (issue #26 point 1, backend/distributed/in_program.py). The 2-rank job
(DDP trains as DDP on CPU gloo does, step by step, with its gradients' all-reduce inside the step's fused graph,
only the ranks' check between programs; an FSDP2 step with its all_gather and reduce_scatter inside the graph;
the functional collectives and an async all_reduce; the same with TPU_AGENT_COLLECTIVES_IN_PROGRAM=0, its
collectives between programs; a rank that reads its loss mid-step) is the fused part of COMPILED, in the job of
tests/distributed/test_collectives.py. Here: the recording in process, over a group of this one process (not
slow); and a rank that never joins a fused graph ending the job with one line naming the graph (the ranks' check
before it)."""

from __future__ import annotations

import textwrap

import pytest

from support.processes import clean_env, run_python


@pytest.mark.parametrize("switch,graphs,between", [("1", 1, 1), ("0", 0, 1)])
def test_a_collective_is_a_node_of_the_fused_graph_and_the_graph_runs_over_its_ranks(switch, graphs, between,
                                                                                    monkeypatch):
    """In process, over a group of one rank (this process): what the 2-rank job checks, at no launch cost.
    Switch on: the all_reduce is recorded, one graph holds it (its ops name it) and runs over the group's mesh,
    and between programs runs only the ranks' check. Switch off: the all_reduce itself runs between programs.
    The values are the same."""
    import torch

    from tpu_agent.backend.core import executables
    from tpu_agent.backend.distributed import collectives, in_program, tensor_ops
    from tpu_agent.backend.core.state import STATE

    monkeypatch.setenv(in_program.SWITCH.name, switch)
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
        y = torch.arange(4.0, device="tpu") * 2
        before, known = STATE.distributed.collectives.runs, len(executables.all())
        tensor_ops.all_reduce_(y, (collectives.my_rank(),), "sum")
        assert (y + 1).cpu().tolist() == [1.0, 3.0, 5.0, 7.0]
    holding = [e for e in executables.all()[known:] if "c10d.all_reduce(sum)" in e.ops]
    assert (len(holding), STATE.distributed.collectives.runs - before) == (graphs, between)


NEVER_JOINS = textwrap.dedent("""
    from datetime import timedelta
    import torch, torch.distributed as dist
    dist.init_process_group(timeout=timedelta(seconds=4))
    x = torch.ones(4, device="tpu") * 2
    if dist.get_rank() == 0:  # rank 1 never all-reduces
        dist.all_reduce(x)
    print(dist.get_rank(), x.cpu().tolist(), flush=True)
""")


@pytest.mark.slow  # a torchrun job of 2 ranks that times out (about 20 s)
def test_a_rank_that_never_joins_a_fused_graph_ends_the_job_with_one_line_naming_the_graph(tmp_path):
    (tmp_path / "never.py").write_text(NEVER_JOINS)
    proc = run_python("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "never.py",
                      cwd=tmp_path, env=clean_env(TORCH_TPU_DEFER_AND_FUSE="1"), timeout=200)
    assert proc.returncode != 0
    line = ("tpu: rank 0: the start of a fused graph with c10d.all_reduce(sum) x1 over ranks [0, 1] did not "
            "complete within 4 s (the process group's timeout): rank 1 did not join it")
    assert line in proc.stderr, proc.stderr[-3000:]
