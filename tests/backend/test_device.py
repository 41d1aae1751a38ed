"""The `tpu` device as a script sees it: registration, torch.tpu, tensors, RNG."""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap

import pytest
import torch

from tpu_agent.backend.core.tensor import TpuTensor


def run_python(code: str, env_extra: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    import os

    env = dict(os.environ)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=120)


def test_import_torch_alone_registers_the_device():
    out = run_python("""
        import torch
        x = torch.ones(2, 3).to("tpu")
        print(x.device, x.is_tpu, torch.device("tpu").type, torch.nn.Linear(2, 2).tpu().weight.is_tpu)
        print(torch.ones(2).tpu().device)
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["tpu:0", "True", "tpu", "True", "tpu:0"]


def test_bundled_device_stands_aside_when_torch_tpu_is_installed(tmp_path):
    fake = tmp_path / "torch_tpu"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    out = run_python("""
        import torch
        print(torch._C._get_privateuse1_backend_name(), hasattr(torch, "tpu"))
    """, env_extra={"PYTHONPATH": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["privateuseone", "False"]


def test_accelerator_api():
    torch.ones(1, device="tpu")  # available once used (not before, in a plain-python process)
    assert torch.accelerator.is_available()
    assert torch.accelerator.current_accelerator().type == "tpu"
    assert torch.accelerator.device_count() == 1
    assert torch.accelerator.current_device_index() == 0
    torch.accelerator.synchronize()


def test_torch_tpu_module(monkeypatch):
    torch.ones(1, device="tpu")
    assert torch.tpu.is_available() and torch.tpu.device_count() == 1
    torch.tpu.synchronize()
    monkeypatch.setenv("TPU_AGENT_GENERATION", "v6e")
    props = torch.tpu.get_device_properties()
    assert props.generation == "v6e" and props.total_memory == 32 * 2**30 and props.mxu == 256
    assert "v6e" in torch.tpu.get_device_name()
    monkeypatch.setenv("TPU_AGENT_GENERATION", "v9")
    with pytest.raises(ValueError, match="v9"):
        torch.tpu.get_device_properties()


def test_eager_mode_and_precision_switches():
    mode = torch.tpu.EagerMode
    assert torch.tpu.get_eager_mode() is mode.DEFER_NEVER
    with torch.tpu.set_eager_mode(mode.DEFER_NEVER_AND_LAUNCH_BLOCKING):
        assert torch.tpu.get_eager_mode() is mode.DEFER_NEVER_AND_LAUNCH_BLOCKING
        assert (torch.ones(2, device="tpu") * 3).sum().item() == 6
    assert torch.tpu.get_eager_mode() is mode.DEFER_NEVER
    with torch.tpu.precision(torch.tpu.Precision.HIGHEST):
        from tpu_agent.backend.core import modes

        assert modes.jax_precision() == "highest"
    assert torch.tpu.Precision.DEFAULT.value == "default"
    out = run_python("import torch; print(torch.tpu.get_eager_mode().name)", {"TORCH_TPU_DEFER_AND_FUSE": "1"})
    assert out.stdout.strip() == "DEFER_AND_FUSE", out.stderr


def test_mark_step_notifies_listeners():
    from tpu_agent.backend.core.steps import add_step_listener

    seen = []
    remove = add_step_listener(seen.append)
    torch.tpu.mark_step()
    remove()
    torch.tpu.mark_step()
    assert seen == ["mark_step"]


def test_tensor_basics():
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3).to("tpu")
    assert isinstance(x, TpuTensor) and x.device == torch.device("tpu", 0) and not x.is_cpu and not x.is_meta
    assert x.tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    assert x.sum().item() == 15.0
    assert "device='tpu:0'" in repr(x) and "5." in repr(x)
    assert x.to(torch.bfloat16).dtype == torch.bfloat16 and x.to(torch.bfloat16).device.type == "tpu"
    cpu = x.cpu()
    assert type(cpu) is torch.Tensor and cpu.device.type == "cpu"
    with pytest.raises(TypeError, match="numpy"):
        x.numpy()


def test_save_load_and_state_dict():
    model = torch.nn.Linear(3, 2).to("tpu")
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)  # no map_location: back on the device it was saved from, as on CUDA
    assert all(v.device.type == "tpu" for v in loaded.values())
    buffer.seek(0)
    on_cpu = torch.load(buffer, map_location="cpu")  # map_location wins
    assert all(type(v) is torch.Tensor and v.device.type == "cpu" for v in on_cpu.values())
    other = torch.nn.Linear(3, 2).to("tpu")
    other.load_state_dict(loaded)
    assert torch.equal(other.weight.cpu(), model.weight.cpu())
    assert torch.equal(other.bias.cpu(), model.bias.cpu())


def test_tied_weights_stay_tied():
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head}).to("tpu")
    assert model.emb.weight is model.head.weight
    assert len(list(model.parameters())) == 1


@pytest.mark.parametrize("make", [
    lambda: torch.randn(5, device="tpu"),
    lambda: torch.rand(5, device="tpu"),
    lambda: torch.randint(0, 100, (5,), device="tpu"),
    lambda: torch.nn.functional.dropout(torch.ones(50, device="tpu"), 0.5),
    lambda: torch.ones(50, device="tpu").bernoulli_(0.3),
], ids=["randn", "rand", "randint", "dropout", "bernoulli"])
def test_rng_is_reproducible_under_manual_seed(make):
    torch.manual_seed(7)
    a = make().cpu()
    b = make().cpu()
    torch.manual_seed(7)
    c = make().cpu()
    assert torch.equal(a, c)
    assert not torch.equal(a, b)


def test_rng_state_round_trip():
    torch.manual_seed(1)
    state = torch.tpu.get_rng_state()
    a = torch.rand(4, device="tpu").cpu()
    torch.tpu.set_rng_state(state)
    assert torch.equal(a, torch.rand(4, device="tpu").cpu())
    assert torch.tpu.initial_seed() == 1


def test_dropout_statistics():
    torch.manual_seed(0)
    x = torch.ones(100_000, device="tpu")
    y = torch.nn.functional.dropout(x, 0.25).cpu()
    kept = (y != 0).float().mean().item()
    assert abs(kept - 0.75) < 0.01
    assert torch.allclose(y[y != 0], torch.tensor(1 / 0.75))


def test_compiled_programs_persist_in_the_xla_cache_for_the_next_process(tmp_path):
    """Three processes (each check of the cache in one of them): the first, with TPU_AGENT_XLA_CACHE empty, writes
    its programs to the default place, the tool's cache directory; the second names that folder as
    TPU_AGENT_XLA_CACHE, with another cache directory, and reads them there (compiles none again, writes nothing
    in its own cache directory); the third, with the cache `off`, writes nothing."""
    code = """
        import torch
        x = torch.ones(3, 5).to("tpu")
        print(float((x * 2 + 1).sum()))
    """
    home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
    first = run_python(code, {"TPU_AGENT_XLA_CACHE": "", "TPU_AGENT_CACHE_DIR": str(home)})
    assert first.returncode == 0, first.stderr
    cache = home / "xla"
    assert cache.is_dir(), "by default the cache lives in the tool's cache directory"
    entries = sorted(p.name for p in cache.iterdir())
    assert entries, "nothing was written to the compilation cache"
    second = run_python(code, {"TPU_AGENT_XLA_CACHE": str(cache), "TPU_AGENT_CACHE_DIR": str(elsewhere)})
    assert second.returncode == 0 and second.stdout == first.stdout
    assert sorted(p.name for p in cache.iterdir()) == entries  # the same programs: read, not compiled again
    assert not (elsewhere / "xla").exists()  # the folder named was the one used

    off = run_python(code, {"TPU_AGENT_XLA_CACHE": "off", "TPU_AGENT_CACHE_DIR": str(elsewhere)})
    assert off.returncode == 0, off.stderr
    assert not (elsewhere / "xla").exists()
