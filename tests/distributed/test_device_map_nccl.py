"""Scripts written for GPUs, NCCL and all, under `tpu-agent run --nproc 2 --device-map cuda=tpu` (issue #26 point
1): `init_process_group("nccl" | backend="nccl", device_id=... | "cpu:gloo,cuda:nccl")`,
`torch.cuda.set_device(LOCAL_RANK)`, `cuda:LOCAL_RANK`, `DDP(device_ids=[LOCAL_RANK])` and
`init_device_mesh("cuda", (dp, tp))` run on the tpu backend and match the same script on CPU gloo (where it
finds no CUDA) rank by rank. Without --device-map nothing is mapped: "nccl" stays PyTorch's."""

from __future__ import annotations

import json

import pytest

from support.paths import DATA, EXAMPLES
from support.processes import clean_env, run_python, run_tool
from support.rank_runs import Case, check

SCRIPTS = DATA / "scripts"


def test_nccl_backend_strings_name_the_tpu_backend_and_others_stay():
    import torch  # noqa: F401 - registers the tpu backend

    from tpu_agent.run.device_map import _backend

    assert _backend("nccl", "cuda", "tpu") == "tpu"
    assert _backend("NCCL", "cuda", "tpu") == "tpu"
    assert _backend("cpu:gloo,cuda:nccl", "cuda", "tpu") == "cpu:gloo,tpu:tpu"
    assert _backend("cuda:nccl", "cuda", "tpu") == "tpu:tpu"
    for kept in ("gloo", "cpu:gloo", "tpu", "undefined", None):
        assert _backend(kept, "cuda", "tpu") == kept


def test_the_ranks_cuda_index_is_its_one_tpu_device_only_in_a_launched_job(monkeypatch):
    import torch

    from tpu_agent.run.device_map import _device

    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert _device("cuda:1", "cuda", "tpu") == "tpu:0"
    assert _device(torch.device("cuda", 1), "cuda", "tpu") == torch.device("tpu", 0)
    assert _device("cuda:3", "cuda", "tpu") == "tpu:3"  # not this rank's: left for set_device to refuse
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert _device("cuda:1", "cuda", "tpu") == "tpu:1"


def test_without_device_map_nccl_is_left_as_pytorch_has_it(tmp_path):
    code = ("import torch, torch.distributed as dist\n"
            "from torch.distributed import distributed_c10d as c\n"
            "print(str(c.BackendConfig('nccl')), hasattr(c._new_process_group_helper, '__wrapped__'),"
            " dist.get_backend is c.get_backend)")
    proc = run_python("-c", code, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["cuda:nccl", "False", "True"]


def _runs(script, tmp_path, args=()) -> tuple[list[dict], list[dict]]:
    """The script (a name in tests/data/scripts, or a path) at 2 ranks on tpu under --device-map cuda=tpu, and
    under plain torchrun with the tool off."""
    (tmp_path / "tpu").mkdir()
    (tmp_path / "gloo").mkdir()
    script = SCRIPTS / script
    tpu = run_tool("run", "--nproc", "2", "--device-map", "cuda=tpu", str(script), "--", *args,
                   "--out", str(tmp_path / "tpu"), cwd=tmp_path, timeout=300)
    assert tpu.returncode == 0, tpu.stderr[-4000:]
    gloo = run_python("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
                      *args, "--out", str(tmp_path / "gloo"), cwd=tmp_path, env=clean_env(TPU_AGENT_DEVICE="off"),
                      timeout=300)
    assert gloo.returncode == 0, gloo.stderr[-4000:]
    return tuple([json.loads((tmp_path / on / f"rank{r}.json").read_text()) for r in range(2)]
                 for on in ("tpu", "gloo"))


@pytest.mark.slow  # two 2-rank jobs (about 100 s at load 10)
def test_a_cuda_ddp_script_with_nccl_runs_on_tpu_and_matches_cpu_gloo(tmp_path):
    """init_process_group(backend="nccl", device_id=torch.device("cuda", LOCAL_RANK)), set_device(LOCAL_RANK),
    cuda:LOCAL_RANK, DDP(device_ids=[LOCAL_RANK]), .cuda(), a new_group(). Each step's loss and every parameter
    within 1e-5 relative of gloo's."""
    tpu, gloo = _runs(EXAMPLES / "ddp.py", tmp_path, ["--device", "cuda", "--init", "keyword", "--steps", "4"])
    assert check(Case("ddp.py", (), 1e-5, 1e-5), tpu, gloo) == []
    assert tpu[0]["losses"] != tpu[1]["losses"]  # each rank its own shard of the data
    for rank in tpu:
        assert (rank["backend"], rank["new_group_backend"]) == ("nccl", "nccl")
        assert (rank["tensor_device"], rank["is_cuda"], rank["total"]) == ("tpu", True, 3.0)
    assert [r["backend"] for r in gloo] == ["gloo", "gloo"]


@pytest.mark.slow  # two 2-rank jobs (about 110 s at load 10)
@pytest.mark.matrix  # the default pass: FSDP2 x tensor parallel on a 1 x 2 mesh against gloo
# (tests/plan/test_parallelism.py), a CUDA script's backend strings mapped (the first tests here) and its DDP job
# (above) under --device-map
def test_an_fsdp2_tp_script_on_a_cuda_device_mesh_runs_on_tpu_and_matches_cpu_gloo(tmp_path):
    """init_process_group("cpu:gloo,cuda:nccl"), init_device_mesh("cuda", (1, 2)): tensor parallel over "tp", FSDP2
    over "dp", examples/fsdp2.py's model; within 1e-5 relative of gloo's."""
    tpu, gloo = _runs("fsdp_tp_cuda.py", tmp_path)
    assert check(Case("fsdp_tp_cuda.py", (), 1e-5, 1e-5), tpu, gloo) == []
    assert [(r["mesh_device"], r["backend"]) for r in tpu] == [("tpu", "cpu:gloo,cuda:nccl")] * 2
