"""`tpu-agent project` on torch.distributed scripts (issue #26 point 6: their meshes ranked for a slice by
projection): the script runs as one rank, its fully_shard / parallelize_module / DDP leave the model unchanged,
and the projection shards the step by its own mesh."""

from __future__ import annotations

import json

import pytest
import torch

from support.paths import EXAMPLES
from tpu_agent.cli.app import run_cli
from tpu_agent.projection import distributed
from tpu_agent.run import rendezvous


@pytest.mark.parametrize("example, mesh", [
    # examples/fsdp2.py's model and its fully_shard on fsdp=8: the default pass projects them in the GPU script below
    # (tests/data/scripts/fsdp_tp_cuda.py imports that model), and fully_shard through this command in fsdp_tp
    pytest.param("fsdp2", "fsdp=8", marks=[pytest.mark.matrix, pytest.mark.slow]),
    ("fsdp_tp", "fsdp=4,tensor=2"), ("ddp", "data=8")])
def test_a_distributed_example_projects_with_the_projections_own_mesh(example, mesh, tmp_path, capsys,
                                                                         monkeypatch):
    for name in rendezvous.RENDEZVOUS:  # as a user's shell has them: no launcher
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    code = run_cli(["project", str(EXAMPLES / f"{example}.py"), "--target", "v5e-8", "--mesh", mesh,
                    "--json", str(tmp_path / "p.json")])
    out, err = capsys.readouterr()
    assert code == 0, err
    data = json.loads((tmp_path / "p.json").read_text())
    axes = {axis: int(n) for axis, n in (part.split("=") for part in mesh.split(","))}
    assert data["mesh"] == axes and data["step_s"] > 0 and data["model_flops"] > 0
    assert any(c["axes"] for c in data["collectives"])  # the projection's own collectives, over its mesh
    assert "projected for v5e-8" in out


def test_a_gpu_script_under_a_device_map_projects_as_it_runs(tmp_path, monkeypatch):
    """`tune --device-map cuda=tpu --target SLICE`: the projection's child gets the map as the tune's children do,
    so a script that checks torch.cuda.is_available() and calls .to("cuda") / .cuda() is traced on meta (it
    failed: the unmapped script took its CPU branch and copied out of meta)."""
    from support.paths import REPO
    from tpu_agent import envvars
    from tpu_agent import slices
    from tpu_agent.run import projection as run

    for name in rendezvous.RENDEZVOUS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(envvars.DEVICE_MAP.name, "cuda=tpu")
    script = REPO / "tests" / "data" / "scripts" / "fsdp_tp_cuda.py"
    partitioned, projection = run.project(str(script), ["--tp", "1", "--out", str(tmp_path)], slices.parse("v5e-8"),
                                          {"fsdp": 8})
    assert partitioned.blocks_total == 3 and projection.step_s > 0
    # examples/fsdp2.py's model under fully_shard, projected by the projection's own mesh (what the matrix's fsdp2
    # case of the test above checks through the command line)
    assert projection.mesh == {"fsdp": 8} and projection.model_flops > 0 and projection.label == "projected for v5e-8"
    assert any(c.axes for c in projection.collectives)


def test_one_rank_env_is_added_only_where_no_launcher_set_it():
    env = rendezvous.one_rank({"PATH": "/bin"})
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["MASTER_ADDR"]) == ("0", "1", "0", "127.0.0.1")
    assert int(env["MASTER_PORT"]) > 0
    launched = {"RANK": "1", "WORLD_SIZE": "2"}
    assert rendezvous.one_rank(launched) is launched


def test_the_scripts_wrappers_leave_the_module_unchanged_and_come_back_after():
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    model = torch.nn.Linear(2, 2)
    with distributed.script_parallelism_left_out():
        import torch.distributed.fsdp as fsdp
        import torch.nn.parallel as parallel

        assert fsdp.fully_shard(model, reshard_after_forward=False) is model
        wrapped = parallel.DistributedDataParallel(model, device_ids=[0])
        assert wrapped is model and wrapped.module is model and "module" not in dict(model.named_children())
        with wrapped.no_sync():
            pass
        assert len(model.state_dict()) == 2  # no cycle through .module
    import torch.distributed.fsdp as fsdp
    import torch.nn.parallel as parallel

    assert fsdp.fully_shard is fully_shard and parallel.DistributedDataParallel is DistributedDataParallel
