"""Collectives over two process groups in one compiled program (issue #26 point 1; backend/distributed/group_mesh.py
and in_program.py): FSDP over "dp" x tensor parallel over "tp" on a 2 x 2 DeviceMesh at 4 ranks, whose steps
alternate dp's all-gather / reduce-scatter and tp's all-reduce, run as ONE program per step over the 4 ranks (each
group the line along one axis of a 2 x 2 mesh of their devices) plus the ranks' check, under torch.compile(step)
and under compiled steps, training as the same script does on CPU gloo in the same job. Groups that are no lines
of one mesh ([0, 1] then [0, 3]) end the graph at each change of group and say why once, with the right values.
Before group_mesh.py each step was 3 graphs and 3 checks (6 programs)."""

from __future__ import annotations

import json
import textwrap

import pytest

from support.processes import clean_env, run_python
STEPS = 5

SCRIPT = textwrap.dedent("""
    import json, sys, warnings
    import torch, torch.distributed as dist
    import torch.nn as nn, torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from tpu_agent.backend.core import executables
    from tpu_agent.backend.distributed import in_program
    from tpu_agent.backend.core.state import STATE

    STEPS = int(sys.argv[1])
    warnings.simplefilter("ignore")
    dist.init_process_group()  # tpu for tpu tensors, gloo for CPU ones
    rank = dist.get_rank()
    meshes = {d: init_device_mesh(d, (2, 2), mesh_dim_names=("dp", "tp")) for d in ("tpu", "cpu")}
    out = {}

    def programs():  # every XLA program run: fused graphs, replays, eager ops, collectives between programs
        return sum(e.calls for e in executables.all()) + STATE.distributed.collectives.runs

    def build(device):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)).to(device)
        mesh = meshes[device]
        parallelize_module(net, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        model = fully_shard(net, mesh=mesh["dp"])
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train(name, compiled):
        models = {d: build(d) for d in ("tpu", "cpu")}
        def step_of(model, opt):
            def step(x, y):
                loss = F.mse_loss(model(x), y)
                loss.backward(); opt.step(); opt.zero_grad()
                return loss
            return step
        steps = {d: step_of(*models[d]) for d in models}
        if compiled:
            steps["tpu"] = torch.compile(steps["tpu"])
        g = torch.Generator().manual_seed(rank // 2)  # a batch per dp index, the same on both tp ranks
        result = out[name] = {"tpu": [], "cpu": [], "programs": []}
        for _ in range(STEPS):
            xb = torch.randn(8, 16, generator=g)
            for d in ("tpu", "cpu"):
                x, y = xb.to(d), xb[:, :4].to(d)
                if d == "tpu":
                    torch.tpu.synchronize()
                    p0 = programs()
                loss = steps[d](x, y)
                if d == "tpu":
                    torch.tpu.synchronize()
                    result["programs"].append(programs() - p0)
                result[d].append(loss.item())
        result["params"] = [((p.full_tensor().cpu() - q.full_tensor()).abs().max() / q.full_tensor().abs().max()).item()
                            for p, q in zip(models["tpu"][0].parameters(), models["cpu"][0].parameters())]
        if compiled:
            result["replays"], result["reason"] = steps["tpu"]._target.replays, steps["tpu"]._target.reason_not_replayed

    train("compile", True)
    out["orders"] = sorted({in_program.collective_order(e.fn.compiled.as_text()) for e in executables.all()
                            if isinstance(e.fn, in_program.SpmdGraph) and e.fn.ranks == (0, 1, 2, 3)})

    # Groups that are no lines of one mesh: [0, 1] / [2, 3] then [0, 3] / [1, 2], in one compiled function.
    rows = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    cross = [dist.new_group([0, 3]), dist.new_group([1, 2])]
    row, across = rows[rank // 2], cross[0 if rank in (0, 3) else 1]

    @torch.compile
    def two_sums(t):
        dist.all_reduce(t, group=row)
        t = t * 10
        dist.all_reduce(t, group=across)
        return t + 1

    out["unmeshed"] = two_sums(torch.full((3,), float(rank + 1), device="tpu")).cpu().tolist()

    # tp's group then the world (both axes of the 2 x 2 mesh): one program.
    tp_group = meshes["tpu"]["tp"].get_group()

    @torch.compile
    def nested(t):
        dist.all_reduce(t, group=tp_group)
        t = t * 10 + rank
        gathered = torch.empty(4 * 3, device="tpu")
        dist.all_gather_into_tensor(gathered, t)
        dist.all_reduce(t)
        return t, gathered

    calls = []
    for _ in range(3):  # captured, then replayed
        t = torch.full((3,), float(rank + 1), device="tpu")
        torch.tpu.synchronize()
        p0 = programs()
        results = nested(t)
        torch.tpu.synchronize()
        calls.append((programs() - p0, [o.cpu().tolist() for o in results]))
    out["nested"] = calls, nested._target.replays, nested._target.reason_not_replayed

    torch.tpu.compile_steps()
    train("steps", False)
    dist.barrier()
    dist.destroy_process_group()
    with open(f"rank{rank}.json", "w") as f:
        json.dump(out, f)
""")


@pytest.mark.slow  # one torchrun job of 4 ranks (about 40 s at normal load)
def test_fsdp_x_tp_on_a_2x2_mesh_runs_one_program_per_step_and_matches_cpu_gloo(tmp_path):
    (tmp_path / "script.py").write_text(SCRIPT)
    proc = run_python("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "script.py", str(STEPS),
                      cwd=tmp_path, env=clean_env(), timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for rank, result in enumerate(results):
        for name in ("compile", "steps"):
            run = result[name]
            assert max(abs(a - b) / abs(b) for a, b in zip(run["tpu"], run["cpu"])) < 1e-5, (rank, name, run)
            assert max(run["params"]) < 1e-5, (rank, name, run["params"])
            # From step 4 on (AdamW's state made, the capture agreed): the step's program and the ranks' check.
            assert run["programs"][3:] == [2] * (STEPS - 3), (rank, name, run["programs"])
        # torch.compile(step): captured with its collectives over both groups, replayed (no Python of the step)
        assert result["compile"]["reason"] is None and result["compile"]["replays"] >= STEPS - 3, result["compile"]
        # The step's program over the 4 ranks, as the ranks' check compares it: dp's all-gather, tp's all-reduce, dp's
        # reduce-scatter, each with its groups (a rank whose program put a collective over the other group differs).
        assert len(result["orders"]) == 1, result["orders"]
        order = [(line.split("(")[0].split()[-1], line.split("replica_groups=")[1].split(", ")[0])
                 for line in result["orders"][0].splitlines()]
        dp, tp = "{{0,2},{1,3}}", "{{0,1},{2,3}}"
        assert order == [("all-gather", dp), ("all-reduce", tp), ("reduce-scatter", dp)], order
        # ([0,1] summed: 3 or 7) * 10, then summed over [0, 3] or [1, 2]: 30 + 70 on every rank, plus one.
        assert result["unmeshed"] == [101.0] * 3, (rank, result["unmeshed"])
        # tp sums 3, 3, 7, 7; times 10 plus the rank: 30, 31, 72, 73, gathered in rank order, summed: 206. The
        # second call: the captured program over the 4 ranks, and its check.
        calls, replays, reason = result["nested"]
        assert [values for _, values in calls] == [[[206.0] * 3, [30.0] * 3 + [31.0] * 3 + [72.0] * 3 + [73.0] * 3]] * 3
        assert calls[-1][0] == 2 and replays >= 1 and reason is None, (calls, replays, reason)
    assert "its collectives between programs" not in proc.stderr
    # rank 0: [0, 3]'s spacing cuts across [0, 1]'s axis; rank 1: [0, 1] and [1, 2] are spaced alike
    assert "over groups [0, 1], [0, 3] cannot be one program (the groups' rank spacings 1, 2, 3, 4, 6 do not nest" \
        in proc.stderr, proc.stderr[-3000:]
    assert "over groups [0, 1], [1, 2] cannot be one program (group [1, 2] is not a line" in proc.stderr
    assert "[0, 1, 2, 3] cannot be one program" not in proc.stderr


def test_the_mesh_of_a_ranks_groups():
    """group_mesh.mesh_for: a 2 x 2 DeviceMesh's dp and tp groups from every rank give one mesh; so does tp alone
    over 4 (its dp axis implicit), 2 x 2 x 2 from three groups, and the world beside tp (both axes); groups that
    are no lines of one mesh give a reason."""
    from tpu_agent.backend.distributed.group_mesh import mesh_for

    for me, tp, dp in ((0, (0, 1), (0, 2)), (1, (0, 1), (1, 3)), (2, (2, 3), (0, 2)), (3, (2, 3), (1, 3))):
        mesh = mesh_for([dp, tp], me, 4)
        assert mesh.shape == (2, 2) and mesh.axes == {dp: "mesh0", tp: "mesh1"}, (me, mesh)
    assert mesh_for([(2, 3)], 3, 4).shape == (2, 2)
    assert mesh_for([(1, 5), (4, 5)], 5, 8).shape == (2, 2, 2)  # an implicit middle axis
    cube = mesh_for([(5, 7), (3, 7), (6, 7)], 7, 8)
    assert cube.shape == (2, 2, 2) and cube.axes[(6, 7)] == "mesh2" and cube.axes[(3, 7)] == "mesh0"
    assert mesh_for([(0, 1), (0,)], 0, 4).shape == (2, 2, 1)
    nested = mesh_for([(0, 1), (0, 1, 2, 3)], 1, 4)  # tp and the world: the world spans both axes
    assert nested.shape == (2, 2) and nested.axes == {(0, 1): "mesh1", (0, 1, 2, 3): ("mesh0", "mesh1")}
    assert mesh_for([(1, 3, 5, 7), (4, 5), (1, 5)], 5, 8).axes[(1, 3, 5, 7)] == ("mesh0", "mesh1")
    assert "not evenly spaced" in mesh_for([(0, 1), (0, 1, 3)], 0, 4)
    assert "not a line" in mesh_for([(1, 2), (0, 2)], 2, 4)
    assert "spacings 1, 2, 3, 4, 6 do not nest" in mesh_for([(0, 2), (0, 3)], 0, 6)
    assert "do not nest" in mesh_for([(0, 1), (0, 1, 2)], 0, 6)
    assert "not in group" in mesh_for([(1, 2)], 0, 4)


def test_the_ranks_check_tells_apart_the_same_collective_over_another_group():
    """What the ranks compare before a program over several groups runs (in_program.collective_order) keeps each
    collective's replica groups: a rank whose all-reduce is over dp's groups where another's is over tp's differs."""
    from tpu_agent.backend.distributed.in_program import collective_order

    line = ("  %all-reduce.3 = f32[8,4]{1,0} all-reduce(f32[8,4]{1,0} %a), channel_id=1, replica_groups={{0,1},{2,3}}, "
            "use_global_device_ids=true, to_apply=%region_1.2, metadata={op_name=\"jit(graph)/psum\"}")
    assert "replica_groups={{0,1},{2,3}}" in collective_order(line)
    assert collective_order(line) != collective_order(line.replace("{{0,1},{2,3}}", "{{0,2},{1,3}}"))
