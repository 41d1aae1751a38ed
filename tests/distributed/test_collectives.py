"""The tpu process-group backend at world size 2, launched by torchrun: every collective DDP, FSDP2 and
DTensor use gives the values gloo would, for the three ways a script names the backend (none, for the
default group; "tpu" and "cpu:gloo,tpu:tpu", for new groups), with CPU tensors still going to gloo; the functional collectives and a DTensor on
`init_device_mesh("tpu", ...)` too; and FSDP2 (`fully_shard` per layer and on the root, AdamW) trains
as the same model does on the CPU given both ranks' batches, as does DDP with compiled steps. The results are computed on the device (each rank's tensors stay tpu
tensors) and compared here with values worked out by hand. In the same job: uneven all_to_all, send/recv and
PREMUL_SUM, and point-to-point (isend / irecv / batch_isend_irecv), each against the same call on CPU gloo; then
collectives inside one program (issue #26 point 1; backend/distributed/in_program.py): DDP and FSDP2 steps under
torch.compile and under compiled steps replayed as ONE program per step with their collectives, and fused mode's
graphs holding them (COMPILED; tests/distributed/test_compiled_collectives.py and test_collectives_in_program.py
hold what the ranks' check compares and what needs no job)."""

from __future__ import annotations

import json
import math
import textwrap

import pytest

from support.processes import clean_env, run_python


SCRIPT = textwrap.dedent("""
    import json, sys
    import torch, torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from tpu_agent.backend.compiled.auto_compile import STATE as AUTO_COMPILE
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    # One job, one default group (re-creating the default group in a job reuses its store keys: gloo then
    # connects to the last group's ports), made by EXCHANGES, which runs first in the same job; the other two
    # spellings as groups of their own, built the same way (BackendConfig, then the backend's creator).
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


def _torchrun_2(code: str, tmp_path, *args: str) -> str:
    """`code` at 2 ranks under torchrun in tmp_path; its stderr."""
    script = tmp_path / "script.py"
    script.write_text(code)
    proc = run_python("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script), *args,
                      cwd=tmp_path, env=clean_env(), timeout=500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stderr


def _norm_close(a: list[float], b: list[float], rel: float) -> bool:
    return math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b))) <= rel * math.sqrt(sum(y * y for y in b))


EXCHANGES = textwrap.dedent("""
    import json
    import torch, torch.distributed as dist

    dist.init_process_group()  # tpu tensors on the tpu backend; the same calls on CPU tensors over a gloo group
    rank, world = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    results = {}

    def both(name, fn):
        tpu, cpu = fn("tpu", None), fn("cpu", gloo)
        assert all(t.device.type == "tpu" for t in tpu), name
        results[name] = [[t.cpu().flatten().tolist() for t in tpu], [t.flatten().tolist() for t in cpu]]

    def uneven(splits, dtype):  # MoE's token dispatch: rank r sends splits[r][j] rows of 3 to rank j
        def fn(device, group):
            x = (torch.arange(sum(splits[rank]) * 3) + 100 * rank).reshape(-1, 3).to(dtype).to(device)
            received = [splits[j][rank] for j in range(world)]
            out = torch.empty(sum(received), 3, dtype=dtype, device=device)
            dist.all_to_all_single(out, x, received, splits[rank], group=group)
            return [out]
        return fn

    both("uneven_float", uneven([[1, 3], [2, 0]], torch.float32))

    def functional(device, group):  # funcol, as DTensor and TorchTitan's expert parallelism call it
        import torch.distributed._functional_collectives as funcol
        splits = [[2, 1], [3, 2]]
        x = (torch.arange(sum(splits[rank]) * 2) + 100 * rank).reshape(-1, 2).float().to(device)
        out = funcol.all_to_all_single(x, [splits[j][rank] for j in range(world)], splits[rank],
                                       group if group is not None else dist.group.WORLD)
        return [funcol.wait_tensor(out)]

    both("uneven_functional", functional)
    both("uneven_int", uneven([[5, 0], [1, 2]], torch.int64))  # another padded size: its own program

    def sizes(device, group):  # inputs[j] to rank j, of sizes no two ranks share
        inputs = [torch.arange((rank + 1) * 2, dtype=torch.float32, device=device) + 10 * rank,
                  torch.arange(3 - rank, dtype=torch.float32, device=device) - 10 * rank]
        outputs = [torch.empty((j + 1) * 2 if rank == 0 else 3 - j, device=device) for j in range(world)]
        if device == "tpu":
            dist.all_to_all(outputs, inputs, group=group)
            return outputs
        # gloo's all_to_all takes equal sizes only: the same exchange as all_to_all_single of the concatenation
        flat = torch.empty(sum(len(o) for o in outputs))
        dist.all_to_all_single(flat, torch.cat(inputs), [len(o) for o in outputs], [len(i) for i in inputs], group=group)
        return list(flat.split([len(o) for o in outputs]))

    both("all_to_all_sizes", sizes)

    def point_to_point(device, group):
        t = torch.arange(5, dtype=torch.float32, device=device) + 0.5
        peer = 1 - rank
        back = torch.empty(5, device=device)
        if rank == 0:
            dist.send(t, peer, group=group)
            dist.recv(back, peer, group=group)
        else:
            dist.recv(back, peer, group=group)
            dist.send(back * 2, peer, group=group)
        return [back]

    both("send_recv", point_to_point)

    # PREMUL_SUM (gloo has none): against gloo's SUM of the inputs times the factor
    premul = dist._make_nccl_premul_sum(0.25)
    x = torch.arange(4, dtype=torch.float32) + 10 * rank
    def reduced(kind):
        def fn(device, group):
            op, y = (premul, x.to(device)) if device == "tpu" else (dist.ReduceOp.SUM, x * 0.25)
            if kind == "all_reduce":
                dist.all_reduce(y, op=op, group=group); return [y]
            if kind == "reduce_scatter_tensor":
                out = torch.empty(2, device=device); dist.reduce_scatter_tensor(out, y, op=op, group=group); return [out]
            if kind == "reduce_scatter":
                out = torch.empty(2, device=device); dist.reduce_scatter(out, list(y.chunk(2)), op=op, group=group)
                return [out]
            dist.reduce(y, dst=1, op=op, group=group)
            return [y] if rank == 1 else []
        return fn

    for kind in ("all_reduce", "reduce_scatter_tensor", "reduce_scatter", "reduce"):
        try:
            both(f"premul_{kind}", reduced(kind))
        except Exception as exc:
            results[f"premul_{kind}"] = f"{type(exc).__name__}: {exc}"

    try:
        dist.recv(torch.empty(2, device="tpu"))
    except Exception as exc:
        results["recv_anysource"] = str(exc)
    dist.barrier()
    with open(f"exchanges{rank}.json", "w") as f:  # the job goes on with SCRIPT, in the same default group
        json.dump(results, f)
""")


# Point-to-point on tpu tensors (isend / irecv / batch_isend_irecv) against the same calls on CPU tensors over gloo,
# in the same job after EXCHANGES: equal. Both ranks posting their send before their receive (batch_isend_irecv's
# order) used to pair each rank's send with the other's send and receive zeros.
P2P = textwrap.dedent("""
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
    with open(f"p2p{rank}.json", "w") as f:
        json.dump(out, f)
""")


# Collectives inside one program (issue #26 point 1), in the same job after SCRIPT: a DDP step and an FSDP2 step
# (per layer and root, AdamW) under torch.compile, each captured with its all-reduces / all-gathers /
# reduce-scatters and replayed as ONE program per step with only the ranks' check between programs, a rank that
# reads its loss mid-step among them; then fused mode's graphs holding the collectives (the switch on, then off);
# then FSDP2 under compiled steps, its forward (which holds the all-gathers) run as written inside the step's window.
STEPS = 6  # of each compiled part

FUSED_START, FUSED_END = "=== fused mode ===", "=== fused mode done ==="

COMPILED = textwrap.dedent("""
    import json, os, sys, warnings
    import torch, torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    import torch.nn as nn, torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP
    from tpu_agent.backend.core import executables
    from tpu_agent.backend.core.state import STATE

    # After SCRIPT, in its default group: compiled steps off again for the models made from here on (SCRIPT's DDP
    # model, found by them, stays compiled), until the compiled-steps part below switches them on.
    torch.tpu.compile_steps(False)
    STEPS = int(sys.argv[1])
    batches = [torch.Generator().manual_seed(r) for r in range(world)]
    out = {}

    def programs():  # every XLA program run: fused graphs, replays, eager ops, collectives between programs
        return sum(e.calls for e in executables.all()) + STATE.distributed.collectives.runs

    def net():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))

    def ddp_step(model, opt, read_mid_step=False):
        def step(x, y):
            loss = F.mse_loss(model(x), y)
            if read_mid_step:
                loss.item()
            loss.backward(); opt.step(); opt.zero_grad()
            return loss
        return step

    def run_ddp(name, read_mid_step):
        models = {d: DDP(net().to(d)) for d in ("tpu", "cpu")}
        opts = {d: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for d, m in models.items()}
        steps = {"tpu": torch.compile(ddp_step(models["tpu"], opts["tpu"], read_mid_step)),
                 "cpu": ddp_step(models["cpu"], opts["cpu"])}
        result = out[name] = {"tpu": [], "cpu": [], "programs": []}
        for _ in range(STEPS):
            xs = [torch.randn(8, 16, generator=g) for g in batches]
            for d in ("tpu", "cpu"):
                x, y = xs[rank].to(d), xs[rank][:, :4].to(d)
                if d == "tpu":
                    torch.tpu.synchronize()
                p0 = programs()
                loss = steps[d](x, y)
                if d == "tpu":
                    torch.tpu.synchronize()
                    result["programs"].append(programs() - p0)
                result[d].append(loss.item())
        result["params"] = [(p.cpu() - q.detach()).abs().max().item() for p, q in
                            zip(models["tpu"].module.parameters(), models["cpu"].module.parameters())]
        target = steps["tpu"]._target
        result["replays"], result["reason"] = target.replays, target.reason_not_replayed

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the mid-step reader's step says it cannot be one program
        run_ddp("ddp", False)
        run_ddp("mixed", rank == 0)

    # FSDP2 per layer and on the root, AdamW, against the same model on the CPU trained on both ranks' batches.
    model, reference = net().to("tpu"), net()
    for layer in (model[0], model[3]):
        fully_shard(layer)
    fully_shard(model)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, reference))

    @torch.compile
    def fsdp_step(x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward(); opt.step(); opt.zero_grad()
        return loss

    fsdp = out["fsdp"] = {"tpu": [], "cpu": [], "programs": []}
    for _ in range(STEPS):
        xs = [torch.randn(8, 16, generator=g) for g in batches]
        x, y = xs[rank].to("tpu"), xs[rank][:, :4].to("tpu")
        torch.tpu.synchronize()
        p0 = programs()
        loss = fsdp_step(x, y)
        torch.tpu.synchronize()
        fsdp["programs"].append(programs() - p0)
        ref_losses = [F.mse_loss(reference(x), x[:, :4]) for x in xs]
        (sum(ref_losses) / world).backward(); ref_opt.step(); ref_opt.zero_grad()
        fsdp["tpu"].append(loss.item()); fsdp["cpu"].append(ref_losses[rank].item())
    fsdp["params"] = [(p.full_tensor().cpu() - q.detach()).abs().max().item()
                      for p, q in zip(model.parameters(), reference.parameters())]
    fsdp["replays"], fsdp["reason"] = fsdp_step._target.replays, fsdp_step._target.reason_not_replayed

    # Fused mode (as TORCH_TPU_DEFER_AND_FUSE=1 has it), after a barrier and a line that ends the compiled parts' output.
    dist.barrier()
    print(FUSED_START, file=sys.stderr, flush=True)
    torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE)
    passes = {}
    # One pass with collectives inside the fused graphs, then one with the switch off (read at each collective).
    for switch in ("1", "0"):
        os.environ["TPU_AGENT_COLLECTIVES_IN_PROGRAM"] = switch
        part = {}

        def graphs_with_collectives():
            return sum(e.calls for e in executables.all()
                       if e.kind == "fused" and any(o.startswith("c10d.") for o in e.ops))

        batches = [torch.Generator().manual_seed(r) for r in range(world)]

        # DDP on tpu (fused mode) and on the CPU (gloo), same seed, same batches.
        models = {d: DDP(net().to(d)) for d in ("tpu", "cpu")}
        opts = {d: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for d, m in models.items()}
        ddp = part["ddp"] = {"tpu": [], "cpu": [], "programs": [], "between": [], "in_graph": []}
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
        mixed = part["mixed"] = {"tpu": [], "cpu": []}
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
        fsdp = part["fsdp"] = {"tpu": [], "cpu": [], "in_graph": 0}
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
        part["values"] = {k: v.cpu().tolist() for k, v in values.items()}
        passes[switch] = part
    os.environ.pop("TPU_AGENT_COLLECTIVES_IN_PROGRAM")
    torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_NEVER)
    dist.barrier()
    print(FUSED_END, file=sys.stderr, flush=True)

    # The same under compiled steps (no torch.compile in the loop): the model's forward holds FSDP2's all-gathers,
    # so it runs as written, inside the step's window: the step is still one program.
    torch.tpu.compile_steps()
    model, reference = net().to("tpu"), net()
    for layer in (model[0], model[3]):
        fully_shard(layer)
    fully_shard(model)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, reference))
    steps = out["steps"] = {"tpu": [], "cpu": [], "programs": []}
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for _ in range(STEPS):
            xs = [torch.randn(8, 16, generator=g) for g in batches]
            x, y = xs[rank].to("tpu"), xs[rank][:, :4].to("tpu")
            torch.tpu.synchronize()
            p0 = programs()
            loss = F.mse_loss(model(x), y)
            loss.backward(); opt.step(); opt.zero_grad()
            torch.tpu.synchronize()
            steps["programs"].append(programs() - p0)
            ref_losses = [F.mse_loss(reference(x), x[:, :4]) for x in xs]
            (sum(ref_losses) / world).backward(); ref_opt.step(); ref_opt.zero_grad()
            steps["tpu"].append(loss.item()); steps["cpu"].append(ref_losses[rank].item())
    steps["said"] = [str(w.message) for w in said if str(w.message).startswith("tpu compile")]
    steps["params"] = [(p.full_tensor().cpu() - q.detach()).abs().max().item()
                       for p, q in zip(model.parameters(), reference.parameters())]
    dist.barrier()
    dist.destroy_process_group()
    with open(f"compiled{rank}.json", "w") as f:
        json.dump({"compiled": out, "fused": passes}, f)
""").replace("FUSED_START", repr(FUSED_START)).replace("FUSED_END", repr(FUSED_END))


def _close(result: dict) -> None:
    tpu, cpu = result["tpu"], result["cpu"]
    assert len(tpu) == len(cpu) == STEPS
    assert max(abs(a - b) / abs(b) for a, b in zip(tpu, cpu)) < 1e-5, (tpu, cpu)
    assert max(result["params"]) < 1e-5, result["params"]


def _near(a: list[float], b: list[float], rel: float) -> None:
    assert len(a) == len(b) and a
    assert max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)) <= rel, (a, b)


def _fused_trains_as_on_the_cpu(rank: int, result: dict) -> None:
    ddp, fsdp = result["ddp"], result["fsdp"]
    _near(ddp["tpu"], ddp["cpu"], 1e-5)
    assert max(ddp["params"]) < 1e-5, ddp["params"]
    _near(result["mixed"]["tpu"], result["mixed"]["cpu"], 1e-5)
    _near(fsdp["tpu"], fsdp["cpu"], 1e-5)
    assert max(fsdp["params"]) < 1e-5, fsdp["params"]
    x = [[float(v + 10 * r) for v in range(4)] for r in (0, 1)]
    total = [a + b for a, b in zip(*x)]
    assert result["values"] == {"all_reduce_async": [2 * t for t in total], "f_all_reduce": total,
                                "f_all_gather": x[0] + x[1], "f_reduce_scatter": total[2 * rank:2 * rank + 2]}


def _compiled_steps_replay_one_program(stderr: str, results: list[dict]) -> None:
    for rank, result in enumerate(results):
        for name in ("ddp", "mixed", "fsdp", "steps"):
            _close(result[name])
        # DDP: step 1 captures, step 2 rebuilds the buckets (a host read: captured again), 3 and 4 agree;
        # FSDP2: step 1 creates AdamW's state, 2 and 3 agree. From then on each step is its program and the
        # ranks' check, no other.
        ddp, fsdp = result["ddp"], result["fsdp"]
        assert (ddp["reason"], ddp["replays"]) == (None, STEPS - 4), ddp
        assert ddp["programs"][4:] == [2] * (STEPS - 4), ddp["programs"]
        assert (fsdp["reason"], fsdp["replays"]) == (None, STEPS - 3), fsdp
        assert fsdp["programs"][3:] == [2] * (STEPS - 3), fsdp["programs"]
        # Compiled steps: step 1 finds the model, 2 captures its forward (which holds the all-gathers: it runs as
        # written from then on, and says why), AdamW's update replays from step 4; each step one program after.
        steps = result["steps"]
        assert steps["programs"][3:] == [2] * (STEPS - 3), steps["programs"]
        assert len(steps["said"]) == 1 and "its forward holds collectives (c10d.all_gather x2)" in steps["said"][0]
        assert steps["said"][0].endswith("it runs as written, recorded into the step's one program")
    # The rank that reads its loss mid-step gives up its capture and runs fused (two graphs and the check); the
    # other replays. Their graphs differ but their collectives come in the same order: each runs its own program
    # over the ranks, and the job ends with the numbers above.
    mixed = [r["mixed"] for r in results]
    assert "mid-step" in mixed[0]["reason"] and mixed[1]["reason"] is None, mixed
    assert mixed[0]["programs"][4:] == [3] * (STEPS - 4) and mixed[1]["programs"][4:] == [2] * (STEPS - 4), mixed
    assert "its collectives between programs" not in stderr


def _fused_graphs_hold_the_collectives(passes: list[dict]) -> None:
    inside = [ranks["1"] for ranks in passes]
    for rank, result in enumerate(inside):
        _fused_trains_as_on_the_cpu(rank, result)
        ddp = result["ddp"]
        # Each step's gradient all-reduce is inside its graph; between programs only the ranks' check that they
        # run the same program (step 1 also builds DDP's buckets and the momentum).
        assert all(n >= 1 for n in ddp["in_graph"]), ddp
        assert ddp["between"][0] == 1 and ddp["between"][2:] == [1, 1], ddp
        assert result["fsdp"]["in_graph"] >= 3, result["fsdp"]
    before = [ranks["0"] for ranks in passes]
    for rank, result in enumerate(before):
        _fused_trains_as_on_the_cpu(rank, result)
        ddp = result["ddp"]
        assert ddp["in_graph"] == [0, 0, 0, 0] and result["fsdp"]["in_graph"] == 0, ddp
        assert all(n >= 1 for n in ddp["between"]), ddp
        # the switch takes programs off every step: the all-reduce and the graph it cut in two
        assert sum(inside[rank]["ddp"]["programs"][2:]) < sum(ddp["programs"][2:]), (inside[rank]["ddp"], ddp)


@pytest.mark.slow  # torchrun, 2 ranks joined in one JAX runtime (about 90 s)
def test_every_collective_at_world_size_2_gives_gloos_values_whichever_way_the_backend_is_named(tmp_path):
    """One job: EXCHANGES, P2P, SCRIPT, then COMPILED. EXCHANGES: all_to_all_single with unequal splits (MoE expert
    parallelism), all_to_all over tensors of different sizes, send/recv, each on tpu against the same call on CPU
    gloo in the same job; PREMUL_SUM in every reducing collective against gloo's sum of the scaled inputs; recv
    without a source refused in one line. SCRIPT: every collective whichever way the backend is named, a DTensor, and
    FSDP2 and DDP under compiled steps on tpu training as the same model on the CPU does. P2P: isend / irecv /
    batch_isend_irecv as gloo's. COMPILED: DDP and FSDP2 steps under torch.compile and compiled steps replaying one
    program with their collectives, and fused mode's graphs holding them (with the switch on and off), each
    training as the same model on CPU gloo or on the CPU given both ranks' batches (_compiled_steps_replay_one_program
    and _fused_graphs_hold_the_collectives say what each checks)."""
    stderr = _torchrun_2(EXCHANGES + P2P + SCRIPT + COMPILED, tmp_path, str(STEPS))
    compiled = [json.loads((tmp_path / f"compiled{rank}.json").read_text()) for rank in (0, 1)]
    # The compiled parts' output, and the rest of the job's: before the fused part's first line, and after its last.
    assert stderr.count(FUSED_START) == stderr.count(FUSED_END) == 2, stderr[-3000:]
    compiled_stderr = stderr.split(FUSED_START)[0] + stderr.rsplit(FUSED_END, 1)[1]
    _compiled_steps_replay_one_program(compiled_stderr, [r["compiled"] for r in compiled])
    _fused_graphs_hold_the_collectives([r["fused"] for r in compiled])
    for rank in (0, 1):
        results = json.loads((tmp_path / f"exchanges{rank}.json").read_text())
        refused = results.pop("recv_anysource")
        assert "recv_anysource" in refused and "\n" not in refused, refused
        assert set(results) == {"uneven_float", "uneven_functional", "uneven_int", "all_to_all_sizes", "send_recv",
                                "premul_all_reduce", "premul_reduce_scatter_tensor", "premul_reduce_scatter",
                                "premul_reduce"}
        for name, got in results.items():
            assert isinstance(got, list), (rank, name, got)
            tpu, gloo = got
            assert tpu == gloo, (rank, name, tpu, gloo)
        assert results["send_recv"][0] == [[1.0, 3.0, 5.0, 7.0, 9.0] if rank == 0 else [0.5, 1.5, 2.5, 3.5, 4.5]]
        assert results["uneven_float"][0][0][:3] == ([0.0, 1.0, 2.0] if rank == 0 else [3.0, 4.0, 5.0])
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
    for rank in (0, 1):
        result = json.loads((tmp_path / f"p2p{rank}.json").read_text())
        assert result["tpu"] == result["cpu"], result
        other = 100.0 * (1 - rank)
        assert result["tpu"][1][0] == [2 * (other + v) for v in range(3)], result  # batch_isend_irecv's receive
    assert json.loads((tmp_path / "p2p1.json").read_text())["tpu"][2] == [1, 1, 1, 1]
