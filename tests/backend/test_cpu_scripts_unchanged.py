"""Installing the tool changes nothing for a script that never uses `tpu`, and pinned
host memory works as on a real accelerator (DataLoader(pin_memory=True), `.pin_memory()`,
`non_blocking=True` copies onto tpu)."""

from __future__ import annotations

import gc
import textwrap

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from support.processes import clean_env, run_python
from support.rank_runs import once_more_if_gloo_aborts

CPU_SUITE = textwrap.dedent("""
    import io, sys
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(12, 2), torch.arange(12))
    for workers in (0, 2):
        batches = [(round(x.sum().item(), 5), y.tolist())
                   for x, y in DataLoader(data, batch_size=4, pin_memory=True, num_workers=workers)]
        print("loader", workers, batches)
    model = torch.nn.Linear(3, 2)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "step": 7}, buf)
    for map_location in (None, "cpu", torch.device("cpu"), lambda storage, loc: storage):
        buf.seek(0)
        loaded = torch.load(buf, map_location=map_location)
        print("load", loaded["step"], [round(v.sum().item(), 6) for v in loaded["model"].values()],
              sorted({v.device.type for v in loaded["model"].values()}))
    x = torch.randn(4, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(x)
        p = F.softmax(y, -1)
    print("autocast", y.dtype, p.dtype, round(y.float().sum().item(), 3), round(p.float().sum().item(), 3))
    print("defaults", torch.ones(2).device, torch.get_default_device(), torch.randn(2).dtype)
    if "--compile" in sys.argv:
        compiled = torch.compile(lambda a: torch.sin(a) * 2 + 1)
        print("compile", [round(v, 5) for v in compiled(torch.arange(4.0)).tolist()])
""")


def _both_ways(tmp_path, installed_args=(), off_args=()):
    script = tmp_path / "cpu_only.py"
    script.write_text(CPU_SUITE)
    runs = {}
    for name, env, args in (("installed", clean_env(), installed_args),
                            ("off", clean_env(TPU_AGENT_DEVICE="off"), off_args)):
        proc = run_python(str(script), *args, cwd=tmp_path, env=env, timeout=300)
        assert proc.returncode == 0, f"{name}:\n{proc.stderr[-3000:]}"
        runs[name] = proc.stdout
    return runs


@pytest.mark.slow  # torch.compile on the CPU
def test_cpu_script_suite_and_torch_compile_on_cpu_print_the_same_with_the_tool_installed_and_off(tmp_path):
    """One run each way of the whole CPU script; with the tool installed, torch.compile on the CPU too, its result
    held to PyTorch's eager CPU result here (the run with the tool off would compile the same function with the
    same inductor: about 5 s of CPU for a value this process computes)."""
    runs = _both_ways(tmp_path, installed_args=("--compile",))
    installed = runs["installed"].splitlines()
    assert installed[:-1] == runs["off"].splitlines()
    assert runs["off"].count("loader") == 2 and runs["off"].count("load ") == 4
    expected = [round(v, 5) for v in (torch.sin(torch.arange(4.0)) * 2 + 1).tolist()]
    assert installed[-1] == f"compile {expected}" and expected[:2] == [1.0, 2.68294]


CPU_DDP = textwrap.dedent("""
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group()  # no backend named: PyTorch picks one for "the accelerator", here the CPU's gloo
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    with open(f"rank{rank}.txt", "w") as out:  # one file a rank: torchrun's ranks share one stdout
        for step in range(3):
            loss = model(torch.randn(16, 8, generator=g)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            out.write(f"rank {rank} step {step} loss {loss.item():.6f} gloo {dist.get_backend() in ('gloo', 'undefined')}\\n")
        out.write(f"weights {[round(v, 6) for v in model.module.weight.flatten().tolist()[:4]]}\\n")
    dist.barrier()  # both ranks done before teardown
    dist.destroy_process_group()
""")



@pytest.mark.slow  # torchrun with 2 ranks, twice (about 20 s)
def test_a_cpu_ddp_script_under_torchrun_runs_the_same_with_the_tool_installed_and_off(tmp_path):
    # Issue #26: with the tool installed, init_process_group() saw tpu as the machine's accelerator and failed.
    script = tmp_path / "ddp.py"
    script.write_text(CPU_DDP)
    runs = {}
    for name, env in (("installed", clean_env()), ("off", clean_env(TPU_AGENT_DEVICE="off"))):
        # A CPU-only script: its collectives are gloo's alone, with the tool installed as without it
        proc = once_more_if_gloo_aborts(lambda: run_python(
            "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script), cwd=tmp_path,
            env=env, timeout=300))
        assert proc.returncode == 0, f"{name}:\n{proc.stderr[-3000:]}"
        runs[name] = [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)]
    assert runs["installed"] == runs["off"]
    assert all(text.count("gloo True") == 3 for text in runs["installed"])


PINNED_TRAIN = textwrap.dedent("""
    import sys
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    device, workers = sys.argv[1], int(sys.argv[2])
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    model = torch.nn.Linear(4, 1).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pinned = []
    for x, y in DataLoader(data, batch_size=8, pin_memory=True, num_workers=workers):
        pinned.append(x.is_pinned())
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print("loss", f"{loss.item():.6f}")
    print("pinned", all(pinned), x.device.type)
""")


def _run_here(script, monkeypatch, capsys, *argv) -> list[str]:
    monkeypatch.setattr("sys.argv", [str(script), *argv])
    exec(compile(PINNED_TRAIN, str(script), "exec"), {"__name__": "__main__"})
    return capsys.readouterr().out.splitlines()


def _check_same_training(out):
    losses = {d: [float(line.split()[1]) for line in lines if line.startswith("loss")] for d, lines in out.items()}
    assert len(losses["tpu"]) == 4
    assert losses["tpu"] == pytest.approx(losses["cpu"], rel=1e-5, abs=1e-6)
    # With the tool installed an accelerator is present, so the loader pins in both runs.
    assert out["tpu"][-1] == "pinned True tpu" and out["cpu"][-1] == "pinned True cpu"


def test_tpu_script_with_pinned_loader_trains_as_on_cpu(tmp_path, capsys, monkeypatch):
    """Batches pinned by the DataLoader move to tpu with non_blocking=True; the losses match
    the same script on the CPU."""
    script = tmp_path / "train.py"
    _check_same_training({d: _run_here(script, monkeypatch, capsys, d, "0") for d in ("tpu", "cpu")})


@pytest.mark.slow
def test_tpu_script_with_pinned_loader_and_workers_trains_as_on_cpu(tmp_path, capsys, monkeypatch):
    """The same with two workers, in a fresh process: batches pinned by the loader's pin thread."""
    script = tmp_path / "train.py"
    script.write_text(PINNED_TRAIN)
    proc = run_python(str(script), "tpu", "2", cwd=tmp_path, env=clean_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The CPU half runs here, in a process that must have used tpu as the tpu run had: the loader pins for the
    # accelerator only once a process uses it (alone, this test's process had not: pinned False, order-dependent).
    torch.ones(1, device="tpu")
    _check_same_training({"tpu": proc.stdout.splitlines(), "cpu": _run_here(script, monkeypatch, capsys, "cpu", "0")})


def test_pin_memory_copies_into_pinned_host_memory():
    t = torch.randn(3, 5).t()
    p = t.pin_memory()
    assert p.is_pinned() and not t.is_pinned()
    assert p.device.type == "cpu" and p.stride() == t.stride() and torch.equal(p, t)
    assert p[1:, 2:].is_pinned(), "a view of pinned memory is pinned"
    assert p.pin_memory() is p
    b = torch.arange(6, dtype=torch.bfloat16).pin_memory()
    assert b.is_pinned() and b.dtype == torch.bfloat16 and b.tolist() == list(range(6))
    e = torch.empty(0, 4).pin_memory()
    assert e.is_pinned() and e.shape == (0, 4)


def test_freed_pinned_memory_is_no_longer_pinned():
    from tpu_agent.backend.integration import pinned

    # The address, not the set's size: an earlier test's pinned batch may be freed by
    # the same collection (CI saw the count drop by two).
    p = torch.ones(1000).pin_memory()
    address = p.untyped_storage().data_ptr()
    assert address in pinned._PINNED
    del p
    gc.collect()
    assert address not in pinned._PINNED


def test_pinned_batches_move_to_tpu_non_blocking():
    data = TensorDataset(torch.arange(8.0).view(4, 2))
    (batch,) = next(iter(DataLoader(data, batch_size=4, pin_memory=True)))
    assert batch.is_pinned()
    moved = batch.to("tpu", non_blocking=True)
    assert moved.device.type == "tpu"
    assert torch.equal(moved.cpu(), batch)


def test_accelerator_semantics_are_those_of_one_tpu_device():
    assert torch.accelerator.current_accelerator() == torch.device("tpu")
    x = torch.ones(3, device="tpu") * 2  # available once used (not before, in a plain-python process)
    assert torch.accelerator.is_available() and torch.accelerator.device_count() == 1
    assert torch.accelerator.current_device_index() == 0
    torch.accelerator.synchronize()
    torch.accelerator.synchronize("tpu")
    assert x.sum().item() == 6.0
    with torch.tpu.device(0):
        assert torch.tpu.current_device() == 0
    with torch.tpu.device_of(x):
        assert torch.tpu.current_device() == 0
    with pytest.raises(RuntimeError, match="out of range"):
        torch.tpu.set_device(1)
    stream = torch.tpu.current_stream()
    assert stream.device == torch.device("tpu", 0) and stream == torch.accelerator.current_stream()
    with torch.tpu.stream(stream):
        assert (x + 1).sum().item() == 9.0


def test_accelerator_memory_functions_report_the_device_memory():
    torch.accelerator.reset_peak_memory_stats()
    before = torch.accelerator.memory_allocated()
    x = torch.zeros(250_000, device="tpu") + 1  # 1 MB held by a live array
    torch.accelerator.synchronize()
    during = torch.accelerator.memory_allocated()
    assert during - before >= 1_000_000
    assert torch.accelerator.max_memory_allocated() >= during
    assert torch.tpu.memory_allocated() == during
    stats = torch.accelerator.memory_stats()
    assert stats["allocated_bytes.all.current"] == during
    free, total = torch.accelerator.get_memory_info()
    assert 0 < free < total and total - free >= during
    del x
    torch.accelerator.empty_cache()
    assert torch.accelerator.memory_allocated() <= during - 1_000_000
