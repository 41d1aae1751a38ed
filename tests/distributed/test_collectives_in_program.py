"""Collectives inside fused mode's graph (issue #26 point 1, backend/distributed/in_program.py), world size 2
under torchrun: DDP trains as DDP on CPU gloo does, step by step, with its gradients' all-reduce inside the
step's fused graph (one SPMD program over the ranks), only the ranks' check between programs; an FSDP2 step
(all_gather and reduce_scatter inside the graph) trains as the same model on the CPU given both ranks' batches;
the functional collectives and an async all_reduce give the values worked out by hand. With
TPU_AGENT_COLLECTIVES_IN_PROGRAM=0 (a second pass of the same job, the switch read at each collective) the same
script computes the same and its collectives run between programs, as before. Where two ranks' graphs differ (a
rank that reads its loss mid-step), each runs its graph op by op. One test checks the recording in process, over a group of this one process (not slow); the last, that a rank
that never joins a fused graph ends the job with one line naming the graph (the ranks' check before it)."""

from __future__ import annotations

import json
import textwrap

import pytest

from support.processes import clean_env, run_python


SCRIPT = textwrap.dedent("""
    import json, os
    import torch, torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    import torch.nn as nn, torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP
    from tpu_agent.backend import executables
    from tpu_agent.backend.state import STATE

    dist.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    passes = {}
    # One pass with collectives inside the fused graphs, then one with the switch off (read at each collective).
    for switch in ("1", "0"):
        os.environ["TPU_AGENT_COLLECTIVES_IN_PROGRAM"] = switch
        out = {}

        def programs():  # every XLA program run: fused graphs, eager ops, collectives between programs
            return sum(e.calls for e in executables.all()) + STATE.distributed.collectives.runs

        def graphs_with_collectives():
            return sum(e.calls for e in executables.all()
                       if e.kind == "fused" and any(o.startswith("c10d.") for o in e.ops))

        def net():
            torch.manual_seed(0)
            return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))

        batches = [torch.Generator().manual_seed(r) for r in range(world)]

        # DDP on tpu (fused mode: TORCH_TPU_DEFER_AND_FUSE=1) and on the CPU (gloo), same seed, same batches.
        models = {d: DDP(net().to(d)) for d in ("tpu", "cpu")}
        opts = {d: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for d, m in models.items()}
        ddp = out["ddp"] = {"tpu": [], "cpu": [], "programs": [], "between": [], "in_graph": []}
        for step in range(4):
            xs = [torch.randn(8, 16, generator=g) for g in batches]
            for d in ("tpu", "cpu"):
                p0, b0, g0 = programs(), STATE.distributed.collectives.runs, graphs_with_collectives()
                loss = F.mse_loss(models[d](xs[rank].to(d)), xs[rank][:, :4].to(d))
                loss.backward(); opts[d].step(); opts[d].zero_grad()
                if d == "tpu":
                    torch.tpu.synchronize()
                    ddp["programs"].append(programs() - p0)
                    ddp["between"].append(STATE.distributed.collectives.runs - b0)
                    ddp["in_graph"].append(graphs_with_collectives() - g0)
                ddp[d].append(loss.item())
        ddp["params"] = [(p.cpu() - q.detach()).abs().max().item() for p, q in
                         zip(models["tpu"].module.parameters(), models["cpu"].module.parameters())]

        # A rank that reads its loss mid-step (rank 0 here): the ranks' graphs differ; the step still trains.
        mixed = out["mixed"] = {"tpu": [], "cpu": []}
        for step in range(2):
            xs = [torch.randn(8, 16, generator=g) for g in batches]
            for d in ("tpu", "cpu"):
                loss = F.mse_loss(models[d](xs[rank].to(d)), xs[rank][:, :4].to(d))
                if rank == 0:
                    loss.item()
                loss.backward(); opts[d].step(); opts[d].zero_grad()
                mixed[d].append(loss.item())

        # FSDP2 per layer and on the root, AdamW, against the same model on the CPU trained on both ranks' batches.
        model, reference = net().to("tpu"), net()
        for layer in (model[0], model[3]):
            fully_shard(layer)
        fully_shard(model)
        opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, reference))
        fsdp = out["fsdp"] = {"tpu": [], "cpu": [], "in_graph": 0}
        g0 = graphs_with_collectives()
        for step in range(3):
            xs = [torch.randn(8, 16, generator=g) for g in batches]
            loss = F.mse_loss(model(xs[rank].to("tpu")), xs[rank][:, :4].to("tpu"))
            loss.backward(); opt.step(); opt.zero_grad()
            ref_losses = [F.mse_loss(reference(x), x[:, :4]) for x in xs]
            (sum(ref_losses) / world).backward(); ref_opt.step(); ref_opt.zero_grad()
            fsdp["tpu"].append(loss.item()); fsdp["cpu"].append(ref_losses[rank].item())
        fsdp["in_graph"] = graphs_with_collectives() - g0
        fsdp["params"] = [(p.full_tensor().cpu() - q.detach()).abs().max().item()
                          for p, q in zip(model.parameters(), reference.parameters())]

        # The functional collectives and an async all_reduce, in one graph.
        x = torch.arange(4, dtype=torch.float32, device="tpu") + 10 * rank
        y = x * 2
        work = dist.all_reduce(y, async_op=True)
        work.wait()
        values = {"all_reduce_async": y, "f_all_reduce": funcol.all_reduce(x, "sum", dist.group.WORLD),
                  "f_all_gather": funcol.all_gather_tensor(x, 0, dist.group.WORLD),
                  "f_reduce_scatter": funcol.reduce_scatter_tensor(x, "sum", 0, dist.group.WORLD)}
        out["values"] = {k: v.cpu().tolist() for k, v in values.items()}
        passes[switch] = out
    dist.barrier()
    dist.destroy_process_group()
    with open(f"rank{rank}.json", "w") as f:
        json.dump(passes, f)
""")


def _job(tmp_path) -> list[dict]:
    """The script at 2 ranks in fused mode, its passes with the switch on ("1") and off ("0") (once more if gloo
    aborted at teardown)."""
    (tmp_path / "script.py").write_text(SCRIPT)
    env = clean_env(TORCH_TPU_DEFER_AND_FUSE="1")
    proc = run_python("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "script.py",
                      cwd=tmp_path, env=env, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]


def _close(a: list[float], b: list[float], rel: float) -> None:
    assert len(a) == len(b) and a
    assert max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)) <= rel, (a, b)


def _trains_as_on_the_cpu(rank: int, result: dict) -> None:
    ddp, fsdp = result["ddp"], result["fsdp"]
    _close(ddp["tpu"], ddp["cpu"], 1e-5)
    assert max(ddp["params"]) < 1e-5, ddp["params"]
    _close(result["mixed"]["tpu"], result["mixed"]["cpu"], 1e-5)
    _close(fsdp["tpu"], fsdp["cpu"], 1e-5)
    assert max(fsdp["params"]) < 1e-5, fsdp["params"]
    x = [[float(v + 10 * r) for v in range(4)] for r in (0, 1)]
    total = [a + b for a, b in zip(*x)]
    assert result["values"] == {"all_reduce_async": [2 * t for t in total], "f_all_reduce": total,
                                "f_all_gather": x[0] + x[1], "f_reduce_scatter": total[2 * rank:2 * rank + 2]}


@pytest.mark.slow  # one torchrun job of 2 ranks, both switch settings in turn (about 40 s at normal load)
def test_ddp_and_fsdp2_in_fused_mode_run_their_collectives_inside_the_graph_and_train_as_on_cpu_gloo(tmp_path):
    passes = _job(tmp_path)
    inside = [ranks["1"] for ranks in passes]
    for rank, result in enumerate(inside):
        _trains_as_on_the_cpu(rank, result)
        ddp = result["ddp"]
        # Each step's gradient all-reduce is inside its graph; between programs only the ranks' check that they
        # run the same program (step 1 also builds DDP's buckets and the momentum).
        assert all(n >= 1 for n in ddp["in_graph"]), ddp
        assert ddp["between"][0] == 1 and ddp["between"][2:] == [1, 1], ddp
        assert result["fsdp"]["in_graph"] >= 3, result["fsdp"]
    before = [ranks["0"] for ranks in passes]
    for rank, result in enumerate(before):
        _trains_as_on_the_cpu(rank, result)
        ddp = result["ddp"]
        assert ddp["in_graph"] == [0, 0, 0, 0] and result["fsdp"]["in_graph"] == 0, ddp
        assert all(n >= 1 for n in ddp["between"]), ddp
        # the switch takes programs off every step: the all-reduce and the graph it cut in two
        assert sum(inside[rank]["ddp"]["programs"][2:]) < sum(ddp["programs"][2:]), (inside[rank]["ddp"], ddp)


@pytest.mark.parametrize("switch,graphs,between", [("1", 1, 1), ("0", 0, 1)])
def test_a_collective_is_a_node_of_the_fused_graph_and_the_graph_runs_over_its_ranks(switch, graphs, between,
                                                                                    monkeypatch):
    """In process, over a group of one rank (this process): what the 2-rank job above checks, at no launch cost.
    Switch on: the all_reduce is recorded, one graph holds it (its ops name it) and runs over the group's mesh,
    and between programs runs only the ranks' check. Switch off: the all_reduce itself runs between programs.
    The values are the same."""
    import torch

    from tpu_agent.backend import executables
    from tpu_agent.backend.distributed import collectives, in_program, tensor_ops
    from tpu_agent.backend.state import STATE

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
