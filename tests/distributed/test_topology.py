"""Each local rank's share of a host (backend/distributed/topology.py), checked against PyTorch/XLA's PJRT launcher.

Source: pytorch/xla, torch_xla/_internal/tpu.py, `configure_topology(local_rank, local_world_size,
base_port=8476)` (commit 41398bfff334fc8d3b1c00be6ea8cc5411f6d6bf), and its tests in
test/pjrt/test_internal_tpu.py (`test_configure_tpu_topology`, cases 'v4-8_process_0', 'v4-8_process_3' and
'v4-16_worker_1_process_0', whose values are copied below). For v5litepod-8, v5p-8 and v6e-8, which those
tests do not list, `xla_configure_topology` below transcribes PyTorch/XLA's function (v4 and later: the
metadata's process bounds times its chips-per-process bounds, one chip per process) and is fed each host's
`tpu-env` metadata: CHIPS_PER_HOST_BOUNDS '2,4,1' for v5litepod-8 and v6e-8 (2x4 chips), '2,2,1' for v4-8
and v5p-8 (2x2 chips), HOST_BOUNDS '1,1,1' (one host).
"""

from __future__ import annotations

import pytest

from tpu_agent.backend.distributed import topology

HOSTS = {  # accelerator type: the tpu-env metadata's CHIPS_PER_HOST_BOUNDS on a single-host slice
    "v4-8": "2,2,1",
    "v5litepod-8": "2,4,1",
    "v5p-8": "2,2,1",
    "v6e-8": "2,4,1",
}


def xla_configure_topology(tpu_env: dict, worker_ips: list[str], local_rank: int, local_world_size: int,
                           base_port: int = 8476) -> dict:
    """PyTorch/XLA's configure_topology for TPU v4 and later (torch_xla/_internal/tpu.py), transcribed: the
    variables it sets with os.environ.setdefault on an empty environment."""
    def mesh(text):
        return tuple(int(d) for d in text.split(","))

    default_process_bounds = mesh(tpu_env["TPU_PROCESS_BOUNDS"])
    chips_per_process = mesh(tpu_env["TPU_CHIPS_PER_PROCESS_BOUNDS"])
    process_bounds = tuple(a * b for a, b in zip(default_process_bounds, chips_per_process))
    worker_id = int(tpu_env["WORKER_ID"])
    ports = list(range(base_port, base_port + local_world_size))
    return {
        "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
        "TPU_PROCESS_BOUNDS": ",".join(str(d) for d in process_bounds),
        "CLOUD_TPU_TASK_ID": str(worker_id * local_world_size + local_rank),
        "TPU_PROCESS_ADDRESSES": ",".join(",".join(f"{ip}:{port}" for port in ports) for ip in worker_ips),
        "TPU_VISIBLE_CHIPS": str(local_rank),
        "TPU_PROCESS_PORT": str(ports[local_rank]),
    }


# PyTorch/XLA's published values (test/pjrt/test_internal_tpu.py, test_configure_tpu_topology).
PUBLISHED = [
    ("v4-8", {"TPU_PROCESS_BOUNDS": "1,1,1", "TPU_CHIPS_PER_PROCESS_BOUNDS": "2,2,1", "WORKER_ID": "0"},
     ["localhost"], 0, 4,
     {"TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1", "TPU_PROCESS_BOUNDS": "2,2,1", "CLOUD_TPU_TASK_ID": "0",
      "TPU_PROCESS_PORT": "8476", "TPU_PROCESS_ADDRESSES": "localhost:8476,localhost:8477,localhost:8478,localhost:8479",
      "TPU_VISIBLE_CHIPS": "0"}),
    ("v4-8", {"TPU_PROCESS_BOUNDS": "1,1,1", "TPU_CHIPS_PER_PROCESS_BOUNDS": "2,2,1", "WORKER_ID": "0"},
     ["localhost"], 3, 4,
     {"TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1", "TPU_PROCESS_BOUNDS": "2,2,1", "CLOUD_TPU_TASK_ID": "3",
      "TPU_PROCESS_PORT": "8479", "TPU_PROCESS_ADDRESSES": "localhost:8476,localhost:8477,localhost:8478,localhost:8479",
      "TPU_VISIBLE_CHIPS": "3"}),
    ("v4-16", {"TPU_PROCESS_BOUNDS": "1,1,2", "TPU_CHIPS_PER_PROCESS_BOUNDS": "2,2,1", "WORKER_ID": "1"},
     ["10.130.0.31", "10.130.0.30"], 0, 4,
     {"TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1", "TPU_PROCESS_BOUNDS": "2,2,2", "CLOUD_TPU_TASK_ID": "4",
      "TPU_PROCESS_PORT": "8476",
      "TPU_PROCESS_ADDRESSES": "10.130.0.31:8476,10.130.0.31:8477,10.130.0.31:8478,10.130.0.31:8479,"
                               "10.130.0.30:8476,10.130.0.30:8477,10.130.0.30:8478,10.130.0.30:8479",
      "TPU_VISIBLE_CHIPS": "0"}),
]


@pytest.mark.parametrize("accelerator_type, tpu_env, ips, rank, world, expected", PUBLISHED)
def test_published_values(accelerator_type, tpu_env, ips, rank, world, expected):
    host = topology.tpu_host(accelerator_type, int(tpu_env["WORKER_ID"]), ips,
                             tpu_env["TPU_CHIPS_PER_PROCESS_BOUNDS"], tpu_env["TPU_PROCESS_BOUNDS"])
    assert topology.tpu_environment(host, rank, world) == expected
    assert xla_configure_topology(tpu_env, ips, rank, world) == expected  # the transcription, checked too


@pytest.mark.parametrize("accelerator_type", sorted(HOSTS))
def test_one_chip_per_process_matches_pytorch_xla(accelerator_type):
    """Every local rank of a host run with one process per chip (torchrun --nproc-per-node = chips)."""
    metadata = f"ACCELERATOR_TYPE: '{accelerator_type}'\nCHIPS_PER_HOST_BOUNDS: '{HOSTS[accelerator_type]}'\n" \
               "HOST_BOUNDS: '1,1,1'\nWORKER_ID: '0'\n"
    facts = topology.parse_tpu_env(metadata)
    from_metadata = topology.tpu_host_from_facts(facts)
    from_type = topology.tpu_host(accelerator_type)  # no metadata: the type's known host shape
    assert from_metadata == from_type
    chips = from_type.chips
    assert chips == {"v4-8": 4, "v5p-8": 4, "v5litepod-8": 8, "v6e-8": 8}[accelerator_type]
    xla_env = {"TPU_PROCESS_BOUNDS": "1,1,1", "TPU_CHIPS_PER_PROCESS_BOUNDS": HOSTS[accelerator_type],
               "WORKER_ID": "0"}
    seen = set()
    for rank in range(chips):
        ours = topology.tpu_environment(from_type, rank, chips)
        assert ours == xla_configure_topology(xla_env, ["localhost"], rank, chips)
        seen.add(ours["TPU_VISIBLE_CHIPS"])
    assert seen == {str(c) for c in range(chips)}  # every chip owned, none twice


@pytest.mark.parametrize("accelerator_type, world, expected", [
    ("v5litepod-8", 2, [("2,2,1", "1,2,1", "0,1,2,3"), ("2,2,1", "1,2,1", "4,5,6,7")]),
    ("v6e-8", 4, [("2,1,1", "1,4,1", "0,1"), ("2,1,1", "1,4,1", "2,3"), ("2,1,1", "1,4,1", "4,5"),
                  ("2,1,1", "1,4,1", "6,7")]),
    ("v4-8", 2, [("2,1,1", "1,2,1", "0,1"), ("2,1,1", "1,2,1", "2,3")]),
    ("v5p-8", 1, [("2,2,1", "1,1,1", "0,1,2,3")]),
])
def test_several_chips_per_process(accelerator_type, world, expected):
    """Fewer processes than chips: each a contiguous block (chip ids run x fastest), as JAX's multi-process
    tests hand out TPU_VISIBLE_CHIPS."""
    host = topology.tpu_host(accelerator_type)
    got = [topology.tpu_environment(host, r, world) for r in range(world)]
    assert [(e["TPU_CHIPS_PER_PROCESS_BOUNDS"], e["TPU_PROCESS_BOUNDS"], e["TPU_VISIBLE_CHIPS"]) for e in got] == \
        expected


def test_uneven_split_is_refused():
    with pytest.raises(ValueError, match="evenly"):
        topology.tpu_environment(topology.tpu_host("v5litepod-8"), 0, 3)
    with pytest.raises(ValueError, match="unknown TPU accelerator type"):
        topology.tpu_host("v9z-8")
    with pytest.raises(ValueError, match="TPU_HOST_BOUNDS"):
        topology.tpu_host("v5p-32")  # four hosts: their arrangement comes from the metadata


def test_gpu_share():
    assert topology.gpu_share(1, 4, 8) == ([2, 3], {})
    assert topology.gpu_share(3, 4, 4) == ([3], {})
    assert topology.gpu_share(5, 8, 4) == ([1], {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"})


def test_rank_share_from_the_launcher(monkeypatch):
    env = {"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4", "JAX_PLATFORMS": "tpu", "TPU_ACCELERATOR_TYPE": "v4-8"}
    share = topology.rank_share(env)
    assert share.platform == "tpu" and share.environment["TPU_VISIBLE_CHIPS"] == "2"
    gpu = topology.rank_share({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "JAX_PLATFORMS": "cuda",
                               "CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    assert gpu.local_device_ids == [2, 3]
    assert topology.rank_share({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}) is None  # one process, all chips
    cpu = topology.rank_share({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "JAX_PLATFORMS": "cpu"})
    assert cpu.platform == "cpu" and cpu.environment == {} and cpu.local_device_ids is None


def test_a_host_this_cannot_split_warns_and_sets_nothing():
    env = {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "3", "JAX_PLATFORMS": "tpu", "TPU_ACCELERATOR_TYPE": "v6e-8"}
    with pytest.warns(UserWarning, match="cannot share the 8 chips"):
        share = topology.rank_share(env)
    assert share.environment == {}
