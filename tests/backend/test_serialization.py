"""Serialization as PyTorch does it on CUDA: `torch.save` then `torch.load` with no map_location gives tensors,
modules and optimizer states back on tpu, `map_location` still wins, a checkpoint crosses between the tool and
plain PyTorch on a CPU both ways, and a compiled model's keys and module tree are PyTorch's OptimizedModule's."""

from __future__ import annotations

import io
import json
import textwrap

import pytest
import torch
import torch.nn as nn

from support.processes import clean_env, run_python, run_tool


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def _trained(model, steps=2):
    """A model and an AdamW with state, trained a few steps on its device."""
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(6, 4, generator=gen).to(device)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    return model, opt


def _saved(obj) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def _devices(tree) -> set[str]:
    from torch.utils._pytree import tree_flatten

    return {t.device.type for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)}


def test_torch_load_without_map_location_restores_tensors_on_tpu_as_cuda_does():
    model, opt = _trained(_model().to("tpu"))
    plain = torch.arange(5.0, device="tpu")
    loaded = torch.load(_saved({"model": model.state_dict(), "opt": opt.state_dict(), "t": plain,
                                "host": torch.ones(2)}))
    assert _devices(loaded["model"]) == {"tpu"}
    for key, value in model.state_dict().items():
        assert torch.equal(loaded["model"][key].cpu(), value.cpu()), key
    state = loaded["opt"]["state"][0]
    assert state["exp_avg"].device.type == "tpu" and state["exp_avg_sq"].device.type == "tpu"
    # Like on CUDA: AdamW keeps `step` on the CPU (not capturable), and a CPU tensor stays a CPU tensor.
    assert state["step"].device == opt.state_dict()["state"][0]["step"].device
    assert loaded["t"].device.type == "tpu" and loaded["t"].tolist() == [0, 1, 2, 3, 4]
    assert loaded["host"].device.type == "cpu"


def test_a_whole_module_and_a_parameter_come_back_on_tpu():
    model, _ = _trained(_model().to("tpu"))
    back = torch.load(_saved(model), weights_only=False)
    params = list(back.parameters())
    assert params and all(isinstance(p, nn.Parameter) and p.requires_grad and p.device.type == "tpu" for p in params)
    assert _devices(back.state_dict()) == {"tpu"}
    x = torch.randn(3, 4)
    model.eval(), back.eval()
    assert torch.equal(back(x.to("tpu")).cpu(), model(x.to("tpu")).cpu())
    p = torch.load(_saved(nn.Parameter(torch.ones(3, device="tpu"))))
    assert isinstance(p, nn.Parameter) and p.requires_grad and p.device.type == "tpu"


def test_training_resumes_exactly_from_a_checkpoint_loaded_without_map_location():
    model, opt = _trained(_model().to("tpu"))
    buf = _saved({"model": model.state_dict(), "opt": opt.state_dict()})
    x = torch.randn(6, 4).to("tpu")

    def step(m, o):
        o.zero_grad()
        loss = m(x).square().mean()
        loss.backward()
        o.step()
        return loss.item()

    straight = [step(model, opt) for _ in range(2)]
    resumed_model = _model().to("tpu")
    resumed_opt = torch.optim.AdamW(resumed_model.parameters(), lr=1e-2)
    state = torch.load(buf)
    resumed_model.load_state_dict(state["model"])
    resumed_opt.load_state_dict(state["opt"])
    assert [step(resumed_model, resumed_opt) for _ in range(2)] == straight


MAP_LOCATIONS = {
    "str_cpu": ("cpu", "cpu"),
    "device_cpu": (torch.device("cpu"), "cpu"),
    "dict_cpu": ({"tpu:0": "cpu"}, "cpu"),
    "dict_other": ({"cuda:0": "cpu"}, "tpu"),  # names another device: the saved location stands
    "function_keeps": (lambda storage, location: storage, "cpu"),  # as on CUDA: the host storage it is given
    "function_tpu": (lambda storage, location: storage.tpu(), "tpu"),
    "str_tpu": ("tpu", "tpu"),
}


@pytest.mark.parametrize("form", list(MAP_LOCATIONS))
def test_map_location_still_wins(form):
    map_location, device = MAP_LOCATIONS[form]
    model, _ = _trained(_model().to("tpu"))
    loaded = torch.load(_saved(model.state_dict()), map_location=map_location)
    assert _devices(loaded) == {device}
    for key, value in model.state_dict().items():
        assert torch.equal(loaded[key].cpu(), value.cpu()), key


def test_a_function_map_location_sees_the_tpu_location_tag():
    seen = []
    torch.load(_saved({"w": torch.ones(2, device="tpu"), "c": torch.ones(2)}),
               map_location=lambda storage, location: seen.append(location) or storage)
    assert sorted(seen) == ["cpu", "tpu:0"]


# A plain PyTorch process (the tool's autoload off, as on a machine without it): reads the tool's checkpoint with
# map_location="cpu" and without, and writes one of its own from a CPU model.
PLAIN = """
import json, sys, torch, torch.nn as nn
assert torch._C._get_privateuse1_backend_name() == "privateuseone" and not hasattr(torch, "tpu")
assert not any(name.startswith("tpu_agent") for name in sys.modules)
ours = torch.load(sys.argv[1], map_location="cpu")
model = torch.load(sys.argv[2], map_location="cpu", weights_only=False)
try:
    torch.load(sys.argv[1])
    error = ""
except RuntimeError as exc:
    error = str(exc)
torch.manual_seed(3)
theirs = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
torch.save(theirs.state_dict(), sys.argv[3])
print(json.dumps({
    "ours": {k: v.tolist() for k, v in ours["model"].items()},
    "devices": sorted({v.device.type for v in ours["model"].values()}),
    "exp_avg": ours["opt"]["state"][0]["exp_avg"].tolist(),
    "module": {k: v.tolist() for k, v in model.state_dict().items()},
    "params": sorted({type(p).__name__ for p in model.parameters()}),
    "error": error,
    "theirs": {k: v.tolist() for k, v in theirs.state_dict().items()},
}))
"""


def test_checkpoints_cross_between_the_tool_and_plain_pytorch_on_a_cpu(tmp_path):
    model, opt = _trained(_model().to("tpu"))
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp_path / "ours.pt")
    torch.save(model, tmp_path / "module.pt")
    script = tmp_path / "plain.py"
    script.write_text(textwrap.dedent(PLAIN))
    proc = run_python(str(script), str(tmp_path / "ours.pt"), str(tmp_path / "module.pt"), str(tmp_path / "theirs.pt"),
                      cwd=tmp_path, env=clean_env(TORCH_DEVICE_BACKEND_AUTOLOAD="0"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    ours = {k: v.cpu() for k, v in model.state_dict().items()}
    assert out["devices"] == ["cpu"]
    for key, value in ours.items():
        assert torch.equal(torch.tensor(out["ours"][key], dtype=value.dtype), value), key
        assert torch.equal(torch.tensor(out["module"][key], dtype=value.dtype), value), key
    assert torch.equal(torch.tensor(out["exp_avg"]), opt.state_dict()["state"][0]["exp_avg"].cpu())
    assert out["params"] == ["Parameter"]
    # Without map_location plain PyTorch cannot restore a tpu location, as a CUDA checkpoint on a CPU-only machine.
    assert "tagged with tpu:0" in out["error"]
    # The other way round: plain PyTorch's CPU checkpoint stays on the CPU here unless mapped.
    theirs = torch.load(tmp_path / "theirs.pt")
    assert _devices(theirs) == {"cpu"}
    on_tpu = torch.load(tmp_path / "theirs.pt", map_location="tpu")
    assert _devices(on_tpu) == {"tpu"}
    for key, value in theirs.items():
        assert value.tolist() == out["theirs"][key] and torch.equal(on_tpu[key].cpu(), value), key
    fresh = _model().to("tpu")
    fresh.load_state_dict(theirs)
    assert all(torch.equal(fresh.state_dict()[k].cpu(), v) for k, v in theirs.items())


def _compiled_names(compiled) -> dict:
    return {"state_dict": list(compiled.state_dict()),
            "parameters": [n for n, _ in compiled.named_parameters()],
            "buffers": [n for n, _ in compiled.named_buffers()],
            "modules": [n for n, _ in compiled.named_modules()],
            "children": [n for n, _ in compiled.named_children()]}


@pytest.mark.parametrize("mode", ["eager", "fused", "compiled steps"])
def test_a_compiled_model_reads_as_pytorchs_optimized_module(mode):
    """Keys, parameters, buffers and module tree of `torch.compile(model)` on tpu, trained in each mode, against
    PyTorch's own OptimizedModule around the same model on the CPU (compiled by Dynamo lazily: never called)."""
    from tpu_agent.backend.compiled import auto_compile

    reference = _compiled_names(torch.compile(_model(), backend="eager"))
    assert reference["state_dict"][0].startswith("_orig_mod.")
    switch = torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE) if mode == "fused" else None
    if mode == "compiled steps":
        auto_compile.compile_steps(True)
    try:
        compiled = torch.compile(_model().to("tpu"))
        _trained(compiled, steps=3)
        assert _compiled_names(compiled) == reference
        state = torch.load(_saved(compiled.state_dict()))
    finally:
        if switch is not None:
            switch.__exit__(None, None, None)
        if mode == "compiled steps":
            auto_compile.compile_steps(False)
    assert list(state) == reference["state_dict"] and _devices(state) == {"tpu"}
    # What nanoGPT does on resume: strip the prefix and load into the bare model.
    bare = _model()
    bare.load_state_dict({k.removeprefix("_orig_mod."): v.cpu() for k, v in state.items()})
    assert torch.equal(bare[0].weight, compiled._orig_mod[0].weight.cpu())


def test_a_model_compiled_by_compiled_steps_pickles_as_written():
    """Compiled steps replace the found model's forward; `torch.save(model)` and `copy.deepcopy` leave it out."""
    import copy

    from tpu_agent.backend.compiled import auto_compile

    model = _model().to("tpu")
    auto_compile.compile_module(model)
    assert "forward" in model.__dict__
    _trained(model)
    back = torch.load(_saved(model), weights_only=False)
    assert "forward" not in back.__dict__ and "forward" not in copy.deepcopy(model).__dict__
    x = torch.randn(3, 4).to("tpu")
    model.eval(), back.eval()
    # The copy runs op by op, the original its compiled program: the same math, XLA's own rounding.
    torch.testing.assert_close(back(x).cpu(), model(x).cpu(), rtol=1e-5, atol=1e-6)


CUDA_SCRIPT = """
import json, sys, torch, torch.nn as nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).to("cuda")
compiled = torch.compile(model)
opt = torch.optim.AdamW(compiled.parameters(), lr=1e-2)
for _ in range(3):
    x = torch.randn(6, 4, device="cuda")
    opt.zero_grad()
    compiled(x).square().mean().backward()
    opt.step()
torch.save({"model": compiled.state_dict(), "opt": opt.state_dict()}, sys.argv[1])
mapped = torch.load(sys.argv[1], map_location="cuda:0")
unmapped = torch.load(sys.argv[1])
cpu = torch.load(sys.argv[1], map_location="cpu")
print(json.dumps({"keys": list(mapped["model"]),
                  "mapped": sorted({v.device.type for v in mapped["model"].values()}),
                  "unmapped": sorted({v.device.type for v in unmapped["model"].values()}),
                  "cpu": sorted({v.device.type for v in cpu["model"].values()}),
                  "exp_avg": mapped["opt"]["state"][0]["exp_avg"].device.type}))
"""


def test_a_cuda_script_under_device_map_saves_pytorchs_keys_and_loads_on_tpu(tmp_path):
    script = tmp_path / "cuda_ckpt.py"
    script.write_text(textwrap.dedent(CUDA_SCRIPT))
    proc = run_tool("run", "--device-map", "cuda=tpu", str(script), "--", str(tmp_path / "ckpt.pt"), cwd=tmp_path,
                    timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["keys"] == ["_orig_mod.0.weight", "_orig_mod.0.bias", "_orig_mod.2.weight", "_orig_mod.2.bias"]
    assert (out["mapped"], out["unmapped"], out["cpu"], out["exp_avg"]) == (["tpu"], ["tpu"], ["cpu"], "tpu")


def test_deepcopy_of_a_tpu_model_copies_its_values_on_tpu():
    """`copy.deepcopy(model)` (EMA weights, the best model kept aside): independent tpu tensors, parameters still
    parameters with their gradients, tied weights still tied. (It crashed the process before.)"""
    import copy

    model, _ = _trained(_model().to("tpu"))
    model[3].weight.grad = torch.ones(2, 8, device="tpu")
    copied = copy.deepcopy(model)
    for (name, p), q in zip(model.named_parameters(), copied.parameters()):
        assert isinstance(q, nn.Parameter) and q.device.type == "tpu" and q is not p, name
        assert torch.equal(q.cpu(), p.cpu()), name
    assert torch.equal(copied[3].weight.grad.cpu(), torch.ones(2, 8))
    with torch.no_grad():
        copied[0].weight.add_(1)
    assert not torch.equal(copied[0].weight.cpu(), model[0].weight.cpu())
    tied = nn.ModuleDict({"a": nn.Linear(2, 2, bias=False), "b": nn.Linear(2, 2, bias=False)})
    tied["b"].weight = tied["a"].weight
    tied = copy.deepcopy(tied.to("tpu"))
    assert tied["a"].weight is tied["b"].weight


def test_a_compiled_model_saves_whole_and_deep_copies_as_pytorchs_optimized_module_does():
    """`torch.save(torch.compile(model))` pickles the model it compiles (its programs are this process's) and
    loads compiled again, on tpu, with the same keys; `copy.deepcopy` likewise. (Pickling failed before.)"""
    import copy

    compiled = torch.compile(_model().to("tpu"))
    _trained(compiled, steps=3)
    x = torch.randn(3, 4).to("tpu")
    compiled.eval()
    for other in (torch.load(_saved(compiled), weights_only=False), copy.deepcopy(compiled)):
        assert type(other) is type(compiled) and other._orig_mod is not compiled._orig_mod
        assert list(other.state_dict()) == list(compiled.state_dict()) and _devices(other.state_dict()) == {"tpu"}
        other.eval()
        assert torch.equal(other(x).cpu(), compiled(x).cpu())
