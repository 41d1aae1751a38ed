"""Collectives inside `torch.compile(step)` programs (issue #26 point 1; backend/distributed/in_program.py), world
size 2 under torchrun: a DDP step and an FSDP2 step (per layer and root, AdamW) are each captured with their
all-reduces / all-gathers / reduce-scatters as parts of the program and replayed as ONE program per step, with
only the ranks' check between programs, training as the same model does on CPU gloo. A rank that reads its loss
mid-step (its capture interrupted, so it runs fused while the other replays) still ends, with the same numbers.
Under compiled steps (compile_steps()) FSDP2's model, whose forward holds its all-gathers, runs as written inside
the step's window: one program per step too.

The same job, between those parts, runs fused mode's (tests/distributed/test_collectives_in_program.py has its
in-process and fault tests): DDP trains as DDP on CPU gloo does, step by step, with its gradients' all-reduce
inside the step's fused graph (one SPMD program over the ranks), only the ranks' check between programs; an FSDP2
step (all_gather and reduce_scatter inside the graph) trains as the same model on the CPU given both ranks'
batches; the functional collectives and an async all_reduce give the values worked out by hand. With
TPU_AGENT_COLLECTIVES_IN_PROGRAM=0 (a second pass, the switch read at each collective) the same script computes
the same and its collectives run between programs. Where two ranks' graphs differ (a rank that reads its loss
mid-step), each runs its graph op by op (and says so: the compiled parts' output, before and after the fused
part's, must not)."""

from __future__ import annotations

import json
import textwrap

import pytest

from support.processes import clean_env, run_python

STEPS = 6

FUSED_START, FUSED_END = "=== fused mode ===", "=== fused mode done ==="

SCRIPT = textwrap.dedent("""
    import json, os, sys, warnings
    import torch, torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    import torch.nn as nn, torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP
    from tpu_agent.backend import executables
    from tpu_agent.backend.state import STATE

    STEPS = int(sys.argv[1])
    dist.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
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
    with open(f"rank{rank}.json", "w") as f:
        json.dump({"compiled": out, "fused": passes}, f)
""").replace("FUSED_START", repr(FUSED_START)).replace("FUSED_END", repr(FUSED_END))


def _job(tmp_path) -> tuple[list[dict], str]:
    """The script at 2 ranks: each rank's {"compiled": ..., "fused": {"1": ..., "0": ...}}, and the job's stderr."""
    (tmp_path / "script.py").write_text(SCRIPT)
    proc = run_python("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "script.py",
                      str(STEPS), cwd=tmp_path, env=clean_env(), timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)], proc.stderr


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


@pytest.mark.slow  # one torchrun job of 2 ranks (about 60 s at normal load)
def test_ddp_and_fsdp2_steps_run_their_collectives_in_one_program_compiled_and_fused_and_match_cpu_gloo(tmp_path):
    """One job, three parts: torch.compile(step) and compiled steps (the programs replayed with their collectives),
    then fused mode (the collectives inside the step's fused graph, with the switch on and off), each training as
    the same model on CPU gloo or on the CPU given both ranks' batches."""
    results, stderr = _job(tmp_path)
    # The compiled parts' output: before the fused part's first line, and after its last.
    compiled_stderr = stderr.split(FUSED_START)[0] + stderr.rsplit(FUSED_END, 1)[1]
    assert stderr.count(FUSED_START) == stderr.count(FUSED_END) == 2, stderr[-3000:]
    _compiled_steps_replay_one_program(compiled_stderr, [r["compiled"] for r in results])
    _fused_graphs_hold_the_collectives([r["fused"] for r in results])


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


HLO = """
  %p = f32[32]{0} slice(%param.1), slice={[{offset}:{end}]}
  %all-gather.1 = f32[64]{0} all-gather(f32[32]{0} %p), channel_id=1, replica_groups={{0,1}}, dimensions={0}, \
use_global_device_ids=true, metadata={op_name="jit(graph)/all_gather" stack_frame_id=3}
  %all-reduce.2 = (f32[4]{0}, f32[4]{0}) all-reduce(%a, %b), channel_id=2, replica_groups={{0,1}}, \
to_apply=%region_0.1, metadata={op_name="jit(graph)/psum"}
  %rs = f32[2]{0} reduce-scatter(f32[4]{0} %c), channel_id=3, replica_groups={{0,1}}, dimensions={0}, to_apply=%r
"""


def test_ranks_agree_on_the_order_of_their_collectives_not_on_the_rest_of_their_programs():
    """What the ranks' check compares (in_program.collective_order): FSDP2's two ranks slice at their own offsets
    and still agree; the same collectives scheduled in another order (as XLA did for two programs differing only in
    a constant, which then hung) do not, nor another shape."""
    from tpu_agent.backend.distributed.in_program import collective_order

    rank0 = HLO.replace("{offset}", "0").replace("{end}", "32")
    rank1 = HLO.replace("{offset}", "32").replace("{end}", "64")
    assert collective_order(rank0) == collective_order(rank1)
    assert len(collective_order(rank0).splitlines()) == 3 and "metadata" not in collective_order(rank0)
    lines = rank0.strip().splitlines()
    reordered = "\n".join([lines[0], lines[2], lines[1], lines[3]])  # the all-reduce before the all-gather
    assert collective_order(reordered) != collective_order(rank0)
    assert collective_order(rank0.replace("f32[2]{0} reduce", "f32[3]{0} reduce")) != collective_order(rank0)
