"""A 2-node x 2-rank torchrun job over loopback, the way a user starts one per host: two `torchrun --nnodes 2
--node-rank k --nproc-per-node 2 --master-addr 127.0.0.1` agents, the tool installed (no `tpu-agent run`),
two simulated devices per rank (TPU_AGENT_DEVICES=2). The four ranks join one JAX job; each trains with DDP and
FSDP2 on tpu and on CPU tensors with gloo, and the losses match step by step; each rank asserts the two devices
it owns are its own and no other rank's (tests/distributed/two_node_job.py)."""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
from pathlib import Path

from support.processes import clean_env

JOB = Path(__file__).with_name("two_node_job.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_two_ranks_each_ddp_and_fsdp2_match_gloo_on_their_own_devices(tmp_path):
    port = _free_port()
    env = clean_env(TPU_AGENT_DEVICES="2", OMP_NUM_THREADS="1")
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
                                str(node), "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
                                str(port), str(JOB), str(tmp_path)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True) for node in (0, 1)]
    outputs = []
    try:
        for agent in agents:
            outputs.append(agent.communicate(timeout=240))
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
    for node, (agent, (_, err)) in enumerate(zip(agents, outputs)):
        assert agent.returncode == 0, f"node {node}:\n{err[-4000:]}"
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert [(r["node"], r["local_rank"]) for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    owned = [tuple(r["devices"]) for r in ranks]
    assert all(len(d) == 2 for d in owned) and len({i for d in owned for i in d}) == 8, owned
    assert all(r["everyone"] == [list(d) for d in owned] for r in ranks)  # all four saw the same split
    for rank, r in enumerate(ranks):
        for kind in ("ddp", "fsdp2"):
            tpu, gloo = r["runs"][f"{kind}-tpu"], r["runs"][f"{kind}-cpu"]
            assert len(tpu) == len(gloo) == 3
            assert all(math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-7) for a, b in zip(tpu, gloo)), \
                (kind, rank, tpu, gloo)
    # The ranks trained on their own batches (different losses) and one model: DDP and FSDP2 agree, step by step.
    assert ranks[0]["runs"]["ddp-tpu"] != ranks[3]["runs"]["ddp-tpu"]
    for r in ranks:
        assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(r["runs"]["ddp-cpu"], r["runs"]["fsdp2-cpu"]))
