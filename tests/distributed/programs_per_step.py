"""XLA programs run per training step, by hand (docs/distributed.md's table; not a test):

    [OLD=1 | ONE_GROUP=1] [TPU_AGENT_COMPILE_STEPS=1 | TORCH_TPU_DEFER_AND_FUSE=1] \
        python -m torch.distributed.run --standalone --nproc-per-node {2,4} \
        tests/distributed/programs_per_step.py {ddp,fsdp,tp,llama} {compile,steps}

`compile`: the step under torch.compile; `steps`: a plain loop (eager; with TPU_AGENT_COMPILE_STEPS=1, compiled
steps; with TORCH_TPU_DEFER_AND_FUSE=1, fused). `tp`: FSDP over "dp" x tensor parallel over "tp" on a
(world / 2) x 2 mesh: 1 x 2 at 2 ranks, 2 x 2 at 4, where dp's and tp's collectives alternate groups; `llama`: the
same with examples/fsdp_tp.py's model and plan (the 2-D script test_scripts.py runs), tokens and cross-entropy.
OLD=1 emulates the tree before collectives were captured (none recorded in a capture; the ranks compare whole
programs); ONE_GROUP=1 the tree before a graph held collectives over several groups (group_mesh.py: each change
of group ends the graph). Prints each rank's programs per step (fused graphs, replays, eager ops, collectives
between programs), the collectives between programs, over 8 steps, and the median wall time of steps 5-8 (the
step's call to its synchronize; a figure of this host, compared only within one run of several settings)."""
import os, re, statistics, sys, time, warnings
import torch, torch.distributed as dist
import torch.nn as nn, torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
from tpu_agent.backend.core import executables
from tpu_agent.backend.distributed import collectives, in_program
from tpu_agent.backend.core.lazy import RECORDER
from tpu_agent.backend.core.state import STATE

which, how, old = sys.argv[1], sys.argv[2], os.environ.get("OLD") == "1"
if old:
    in_program.recording = lambda: (STATE.fused and RECORDER.capture is None and not collectives.RECORDED.on
                                    and in_program.enabled())
    in_program.collective_order = lambda text: re.sub(r"metadata=\{[^}]*\}", "", text)
if os.environ.get("ONE_GROUP") == "1":
    in_program._one_mesh = lambda groups: False
warnings.simplefilter("ignore")
dist.init_process_group()
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4)).to("tpu")
if which == "ddp":
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
elif which == "tp":  # FSDP over "dp" (world / 2 ranks) x tensor parallel over "tp" (two), as examples/fsdp_tp.py
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("tpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)).to("tpu")
    parallelize_module(net, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    model = fully_shard(net, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
elif which == "llama":  # examples/fsdp_tp.py's model, tensor parallel plan and sharding on a (world / 2) x 2 mesh
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
    from fsdp_tp import TP_PLAN, VOCAB, Llama

    mesh = init_device_mesh("tpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    model = Llama().to("tpu")
    for layer in model.layers:
        parallelize_module(layer, mesh["tp"], TP_PLAN)
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
else:
    for layer in (net[0], net[3]):
        fully_shard(layer)
    model = fully_shard(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

def step(x, y):
    if which == "llama":
        loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
    else:
        loss = F.mse_loss(model(x), y)
    loss.backward(); opt.step(); opt.zero_grad()
    return loss

run = torch.compile(step) if how == "compile" else step
g = torch.Generator().manual_seed(rank // 2 if which in ("tp", "llama") else rank)  # tp ranks: one batch
counts, between, seconds = [], [], []
for i in range(8):
    if which == "llama":
        tokens = torch.randint(0, VOCAB, (4, 17), generator=g)
        x, y = tokens[:, :-1].to("tpu"), tokens[:, 1:].to("tpu")
    else:
        xb = torch.randn(8, 16, generator=g)
        x, y = xb.to("tpu"), xb[:, :4].to("tpu")
    torch.tpu.synchronize()
    p0 = sum(e.calls for e in executables.all()) + STATE.distributed.collectives.runs
    b0 = STATE.distributed.collectives.runs
    t0 = time.perf_counter()
    loss = run(x, y)
    torch.tpu.synchronize()
    seconds.append(time.perf_counter() - t0)
    counts.append(sum(e.calls for e in executables.all()) + STATE.distributed.collectives.runs - p0)
    between.append(STATE.distributed.collectives.runs - b0)
    loss.item()
print("COUNTS", rank, which, how, "old" if old else "one-group" if os.environ.get("ONE_GROUP") == "1" else "new",
      counts, between, f"median step {statistics.median(seconds[4:]) * 1e3:.1f} ms (steps 5-8)", flush=True)
dist.barrier()
dist.destroy_process_group()
