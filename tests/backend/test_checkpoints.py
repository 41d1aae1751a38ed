"""Checkpoints on `tpu`: torch.save / torch.load with every map_location form, state dicts
between CPU and tpu models, safetensors, and torch.distributed.checkpoint in one process."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn as nn


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _saved(obj) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


MAP_LOCATIONS = {
    "str": "tpu",
    "str_index": "tpu:0",
    "device": torch.device("tpu"),
    "dict": {"cpu": "tpu"},
    "function_storage_tpu": lambda storage, loc: storage.tpu(),
    "function_storage_to": lambda storage, loc: storage.to(device="tpu"),
}


@pytest.mark.parametrize("form", list(MAP_LOCATIONS))
def test_torch_load_maps_a_cpu_checkpoint_onto_tpu(form):
    cpu = _model().state_dict()
    loaded = torch.load(_saved({"model": cpu, "step": 3, "extra": [torch.arange(3)]}), map_location=MAP_LOCATIONS[form])
    assert type(loaded["model"]) is type(cpu) and list(loaded["model"]) == list(cpu)
    for key, value in loaded["model"].items():
        assert value.device.type == "tpu", key
        assert torch.equal(value.cpu(), cpu[key])
    assert loaded["step"] == 3
    assert loaded["extra"][0].device.type == "tpu" and loaded["extra"][0].tolist() == [0, 1, 2]


def test_torch_load_elsewhere_leaves_tensors_on_the_cpu():
    cpu = _model().state_dict()
    for map_location in (None, "cpu", {"cuda:0": "cpu"}, lambda storage, loc: storage):
        loaded = torch.load(_saved(cpu), map_location=map_location)
        assert all(v.device.type == "cpu" for v in loaded.values())


def test_a_loaded_parameter_stays_a_parameter_and_shared_tensors_stay_shared():
    shared = torch.ones(3)
    loaded = torch.load(_saved({"p": nn.Parameter(torch.ones(2)), "a": shared, "b": shared}), map_location="tpu",
                        weights_only=False)
    assert isinstance(loaded["p"], nn.Parameter) and loaded["p"].requires_grad and loaded["p"].device.type == "tpu"
    assert loaded["a"] is loaded["b"]


def test_a_storage_moved_to_tpu_outside_torch_load_is_a_clear_error():
    storage = torch.ones(2).untyped_storage()
    with pytest.raises(RuntimeError, match="no PyTorch storages"):
        storage.tpu()
    with pytest.raises(RuntimeError, match="no PyTorch storages"):
        storage.to(device="tpu")


def test_state_dicts_move_between_cpu_and_tpu_models():
    cpu_model = _model()
    tpu_model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).to("tpu")
    tpu_model.load_state_dict(torch.load(_saved(cpu_model.state_dict())))
    x = torch.randn(5, 4)
    assert torch.allclose(tpu_model(x.to("tpu")).cpu(), cpu_model(x), atol=1e-6)
    back = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    back.load_state_dict(torch.load(_saved(tpu_model.state_dict())))
    for key, value in back.state_dict().items():
        assert torch.equal(value, cpu_model.state_dict()[key]), key


def test_training_resumes_from_a_checkpoint_loaded_onto_tpu():
    """Model and optimizer state saved mid-run and loaded with map_location='tpu' continue
    exactly as the uninterrupted run."""
    torch.manual_seed(1)
    x, y = torch.randn(8, 4).to("tpu"), torch.randn(8, 2).to("tpu")

    def step(model, opt):
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()

    model = _model().to("tpu")
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(2):
        step(model, opt)
    buf = _saved({"model": model.state_dict(), "opt": opt.state_dict()})
    straight = [step(model, opt) for _ in range(2)]

    resumed_model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).to("tpu")
    resumed_opt = torch.optim.Adam(resumed_model.parameters(), lr=0.01)
    state = torch.load(buf, map_location="tpu")
    assert state["opt"]["state"][0]["exp_avg"].device.type == "tpu"
    resumed_model.load_state_dict(state["model"])
    resumed_opt.load_state_dict(state["opt"])
    resumed = [step(resumed_model, resumed_opt) for _ in range(2)]
    assert resumed == pytest.approx(straight, rel=1e-6)


def test_safetensors_save_and_load(tmp_path):
    from safetensors.torch import load_file, load_model, save_file, save_model

    model = _model().to("tpu")
    save_file(model.state_dict(), tmp_path / "direct.safetensors")
    save_file({k: v.cpu() for k, v in model.state_dict().items()}, tmp_path / "via_cpu.safetensors")
    save_model(model, tmp_path / "model.safetensors")
    for name in ("direct", "via_cpu", "model"):
        loaded = {k: v.to("tpu") for k, v in load_file(tmp_path / f"{name}.safetensors").items()}
        for key, value in model.state_dict().items():
            assert torch.equal(loaded[key].cpu(), value.cpu()), (name, key)
    fresh = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).to("tpu")
    load_model(fresh, tmp_path / "model.safetensors")
    assert all(p.device.type == "tpu" for p in fresh.parameters())
    assert torch.equal(fresh[0].weight.cpu(), model[0].weight.cpu())


def test_distributed_checkpoint_without_a_process_group(tmp_path):
    import torch.distributed.checkpoint as dcp

    model = _model().to("tpu")
    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"model": model.state_dict()}, checkpoint_id=tmp_path / "ckpt")
    target = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).to("tpu")
    for p in target.parameters():
        nn.init.zeros_(p)
    state = {"model": target.state_dict()}
    with pytest.warns(UserWarning, match="single process"):
        dcp.load(state, checkpoint_id=tmp_path / "ckpt")
    target.load_state_dict(state["model"])
    for key, value in model.state_dict().items():
        assert torch.equal(target.state_dict()[key].cpu(), value.cpu()), key
    # A CPU-only save works beside the device too (dcp picks the accelerator's stream loader).
    cpu_model = _model()
    dcp.save({"model": cpu_model.state_dict()}, checkpoint_id=tmp_path / "cpu")
    cpu_state = {"model": {k: torch.zeros_like(v) for k, v in cpu_model.state_dict().items()}}
    dcp.load(cpu_state, checkpoint_id=tmp_path / "cpu")
    assert all(torch.equal(cpu_state["model"][k], v) for k, v in cpu_model.state_dict().items())


def test_torch_tpu_device_is_a_context_manager():
    with torch.tpu.device("tpu:0") as ctx:
        assert ctx.idx == 0 and torch.tpu.current_device() == 0
    with torch.tpu.device(torch.device("tpu")):
        pass
    with pytest.raises(ValueError, match="Expected a tpu device"):
        torch.tpu.device("cpu")
    with pytest.raises(RuntimeError, match="out of range"):
        with torch.tpu.device(1):
            pass
