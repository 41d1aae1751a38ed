"""The tpu process-group backend at world size 2, launched by torchrun: every collective DDP, FSDP2 and
DTensor use gives the values gloo would, for the three ways a script names the backend (none, for the
default group; "tpu" and "cpu:gloo,tpu:tpu", for new groups), with CPU tensors still going to gloo; the functional collectives and a DTensor on
`init_device_mesh("tpu", ...)` too; and FSDP2 (`fully_shard` per layer and on the root, AdamW) trains
as the same model does on the CPU given both ranks' batches, as does DDP with compiled steps. The results are computed on the device (each rank's tensors stay tpu
tensors) and compared here with values worked out by hand."""

from __future__ import annotations

import json
import math
import textwrap

import pytest

from support.processes import clean_env, run_python

GLOO_TEARDOWN_ABORT = "terminate called without an active exception"

SCRIPT = textwrap.dedent("""
    import json, sys
    import torch, torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from tpu_agent.backend.auto_compile import STATE as AUTO_COMPILE
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    # One job, one default group (re-creating the default group in a job reuses its store keys: gloo then
    # connects to the last group's ports); the other two spellings as groups of their own, built the same
    # way (BackendConfig, then the backend's creator).
    dist.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = {"None": dist.group.WORLD, "tpu": dist.new_group(backend="tpu"),
              "cpu:gloo,tpu:tpu": dist.new_group(backend="cpu:gloo,tpu:tpu")}
    results = {}
    x = torch.arange(4, dtype=torch.float32, device="tpu") + 10 * rank
    for backend, group in groups.items():
        out = results[backend] = {"group": type(group).__name__}

        def keep(name, t):
            assert t.device.type == ("cpu" if name == "cpu" else "tpu"), (name, t.device)
            out[name] = t.cpu().flatten().tolist()

        for op in ("SUM", "AVG", "MAX", "MIN", "PRODUCT"):
            y = x.clone()
            dist.all_reduce(y, op=getattr(dist.ReduceOp, op), group=group)
            keep(op, y)
        g = torch.empty(4 * world, device="tpu"); dist.all_gather_into_tensor(g, x, group=group); keep("gather", g)
        parts = [torch.empty(4, device="tpu") for _ in range(world)]; dist.all_gather(parts, x, group=group); keep("gather_list", torch.cat(parts))
        rs = torch.empty(4 // world, device="tpu"); dist.reduce_scatter_tensor(rs, x, group=group); keep("reduce_scatter", rs)
        b = x.clone(); dist.broadcast(b, src=1, group=group); keep("broadcast", b)
        a2a = torch.empty(4, device="tpu"); dist.all_to_all_single(a2a, x, group=group); keep("all_to_all", a2a)
        i = torch.tensor([rank + 1], device="tpu"); dist.all_reduce(i, group=group); keep("int", i)
        c = torch.ones(2) * (rank + 1); dist.all_reduce(c, group=group); keep("cpu", c)
        w = dist.all_reduce(y := x.clone(), async_op=True, group=group); w.wait(); keep("async", y)
        keep("future", dist.all_reduce(x.clone(), async_op=True, group=group).get_future().wait()[0])
        dist.barrier(group=group)
        keep("f_all_reduce", funcol.all_reduce(x, "sum", group))
        keep("f_gather", funcol.all_gather_tensor(x, 0, group))
        keep("f_reduce_scatter", funcol.reduce_scatter_tensor(x, "sum", 0, group))
    mesh = init_device_mesh("tpu", (world,), mesh_dim_names=("dp",))
    d = distribute_tensor(torch.arange(8, dtype=torch.float32).reshape(4, 2).to("tpu"), mesh, [Shard(0)])
    results["dtensor"] = {"local": d.to_local().cpu().flatten().tolist(), "full": d.full_tensor().cpu().flatten().tolist(),
                          "sum": d.sum().full_tensor().cpu().flatten().tolist()}

    gloo = dist.new_group(backend="gloo")  # a group without the tpu backend: one clear error for tpu tensors
    try:
        dist.all_reduce(x, group=gloo)
    except RuntimeError as exc:
        results["gloo_error"] = str(exc)
    dist.barrier()

    # FSDP2, fully_shard per layer and on the root, against the same model on the CPU in this process trained
    # on both ranks' batches (FSDP2 averages the ranks' gradients: the gradient of the mean of their losses).
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard

    def net():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))
    model, reference = net().to("tpu"), net()
    for layer in (model[0], model[3]):
        fully_shard(layer)
    fully_shard(model)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, reference))
    batches = [torch.Generator().manual_seed(r) for r in range(world)]

    def train(steps, model, opt, reference, ref_opt):
        # each rank's loss on its batch, and the reference's on that batch (trained on every rank's)
        out = {"losses": [], "reference": [], "params": {}, "reference_params": {}}
        for step in range(steps):
            xs = [torch.randn(8, 16, generator=g) for g in batches]
            loss = F.mse_loss(model(xs[rank].to("tpu")), xs[rank][:, :4].to("tpu"))
            loss.backward(); opt.step(); opt.zero_grad()
            ref_losses = [F.mse_loss(reference(x), x[:, :4]) for x in xs]
            (sum(ref_losses) / world).backward(); ref_opt.step(); ref_opt.zero_grad()
            out["losses"].append(loss.item()); out["reference"].append(ref_losses[rank].item())
        return out

    fsdp = results["fsdp"] = train(3, model, opt, reference, ref_opt)
    for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
        fsdp["params"][name] = p.full_tensor().cpu().flatten().tolist()
        fsdp["shard"] = list(p.to_local().shape)
        fsdp["reference_params"][name] = ref.detach().flatten().tolist()

    # DDP with compiled steps (no change to the script: compile_steps, fused mode): the wrapped model is
    # compiled, DDP's reducer still all-reduces its gradients (compiling DDP itself lost them).
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.tpu.compile_steps()
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
        model, reference = DDP(net().to("tpu")), net()
        opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
        ddp = results["ddp_compiled"] = train(4, model, opt, reference, ref_opt)
        ddp["params"] = [p.cpu().flatten().tolist() for p in model.module.parameters()]
        ddp["reference_params"] = [p.detach().flatten().tolist() for p in reference.parameters()]
        ddp["compiled"] = len(AUTO_COMPILE.modules)
    dist.barrier()
    dist.destroy_process_group()
    with open(f"rank{rank}.json", "w") as f:
        json.dump(results, f)
""")


def expected(rank: int) -> dict:
    x = [[float(v + 10 * r) for v in range(4)] for r in (0, 1)]
    total = [a + b for a, b in zip(*x)]
    return {
        "group": "TpuProcessGroup",
        "SUM": total, "AVG": [t / 2 for t in total], "MAX": x[1], "MIN": x[0],
        "PRODUCT": [a * b for a, b in zip(*x)],
        "gather": x[0] + x[1], "gather_list": x[0] + x[1],
        "reduce_scatter": total[2 * rank:2 * rank + 2],
        "broadcast": x[1],
        "all_to_all": x[0][2 * rank:2 * rank + 2] + x[1][2 * rank:2 * rank + 2],
        "int": [3], "cpu": [3.0, 3.0], "async": total, "future": total,
        "f_all_reduce": total, "f_gather": x[0] + x[1], "f_reduce_scatter": total[2 * rank:2 * rank + 2],
    }


def _norm_close(a: list[float], b: list[float], rel: float) -> bool:
    return math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b))) <= rel * math.sqrt(sum(y * y for y in b))


@pytest.mark.slow  # torchrun, 2 ranks joined in one JAX runtime (about 30 s)
def test_every_collective_at_world_size_2_gives_gloos_values_whichever_way_the_backend_is_named(tmp_path):
    # ... and FSDP2 on tpu trains as the same model on the CPU does.
    script = tmp_path / "collectives.py"
    script.write_text(SCRIPT)
    for _ in range(2):
        proc = run_python("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
                          cwd=tmp_path, env=clean_env(), timeout=300)
        if proc.returncode == 0 or GLOO_TEARDOWN_ABORT not in proc.stderr:
            break
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in (0, 1):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        fsdp, ddp = results.pop("fsdp"), results.pop("ddp_compiled")
        assert "the process group has no tpu backend" in results.pop("gloo_error")
        assert results.pop("dtensor") == {"local": [float(v) for v in range(4 * rank, 4 * rank + 4)],
                                          "full": [float(v) for v in range(8)], "sum": [28.0]}
        assert set(results) == {"None", "tpu", "cpu:gloo,tpu:tpu"}
        for backend, got in results.items():
            assert got == expected(rank), (rank, backend)
        assert fsdp["shard"] == [2]  # the last bias (4 values) is held half by each rank
        assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(fsdp["losses"], fsdp["reference"])), fsdp
        for name, values in fsdp["params"].items():  # AdamW magnifies rounding in near-zero gradients: by norm
            assert _norm_close(values, fsdp["reference_params"][name], 1e-5), name
        assert ddp["compiled"] == 1  # the model DDP wraps, not DDP
        assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(ddp["losses"], ddp["reference"])), ddp
        for values, reference in zip(ddp["params"], ddp["reference_params"]):
            assert _norm_close(values, reference, 1e-5)
