"""`tpu-agent doctor --check`'s child: the tpu device exercised on every local JAX device, each result checked
against PyTorch on the CPU.

    python -m tpu_agent.run.device_check          (TPU_AGENT_DEVICES=N for N simulated CPU devices)

On each device (made the current tpu device, `tpu:k`): an eager op, a fused
step (EagerMode.DEFER_AND_FUSE), a compiled step (torch.tpu.compile), a host-to-device and a device-to-host
copy; then an all-reduce over the local devices, and under a launcher's job of two or more ranks one over the
ranks (torch.distributed, the tpu backend). Each check is timed twice: its first run (compiles) and a warm one.
Prints one JSON object per check on stdout (`{"device", "check", "ok", "first_ms", "warm_ms", "detail"}`),
then a last `{"done": ...}` object; a check that raises is a failed row with its one-line reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field

from tpu_agent import envvars

RTOL, ATOL = 1e-4, 1e-5
H2D_SHAPE = (1024, 1024)  # 4 MiB of float32


def _emit(**row) -> None:
    sys.stdout.write(json.dumps(row) + "\n")
    sys.stdout.flush()


def _one_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    return text[0] if text else type(exc).__name__


def _timed(fn):
    """(result of the warm run, first ms, warm ms)."""
    import torch

    start = time.perf_counter()
    fn()
    torch.tpu.synchronize()
    first = (time.perf_counter() - start) * 1e3
    start = time.perf_counter()
    out = fn()
    torch.tpu.synchronize()
    return out, first, (time.perf_counter() - start) * 1e3


def _close(got, want, what: str) -> None:
    import torch

    got = got.detach().cpu()
    if not torch.allclose(got, want, rtol=RTOL, atol=ATOL):
        diff = (got - want).abs().max().item()
        raise AssertionError(f"{what} differs from the CPU's by up to {diff:.3g}")


def _on(t, device, what: str) -> None:
    """The tensor's value lives on `device` (the check ran there, not on another device)."""
    placed = t.jax().devices()
    if placed != {device}:
        raise AssertionError(f"{what} is on {sorted(map(str, placed))}, not {device}")


def _model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))


def _batch():
    import torch

    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 32, generator=g), torch.randint(0, 8, (16,), generator=g)


def _step_on(device: str, compiled: bool):
    """A training step's runner on `device` (fresh model and SGD each call) and the loss and weight after it."""
    import torch
    import torch.nn.functional as F

    def run():
        model = _model().to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = (t.to(device) for t in _batch())

        def step(x, y):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        fn = torch.tpu.compile(step) if compiled else step
        losses = [fn(x, y) for _ in range(2)]
        return torch.stack([loss.detach() for loss in losses]), model[0].weight.detach()

    return run


def _checks(device):
    import torch

    a = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    want_eager = (a @ a).relu().sum(0)
    cpu_losses, cpu_weight = _step_on("cpu", compiled=False)()
    host = torch.randn(*H2D_SHAPE, generator=torch.Generator().manual_seed(2))

    def eager():
        x = a.to("tpu")
        got = (x @ x).relu().sum(0)
        _on(got, device, "the eager op's result")
        _close(got, want_eager, "(a @ a).relu().sum(0)")

    def fused():
        with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
            losses, weight = _step_on("tpu", compiled=False)()
            torch.tpu.synchronize()
        _on(weight, device, "the fused step's weights")
        _close(losses, cpu_losses, "the fused step's losses")
        _close(weight, cpu_weight, "the fused step's weights")

    def compiled():
        losses, weight = _step_on("tpu", compiled=True)()
        _on(weight, device, "the compiled step's weights")
        _close(losses, cpu_losses, "the compiled step's losses")
        _close(weight, cpu_weight, "the compiled step's weights")

    state = {}

    def h2d():
        state["on_device"] = host.to("tpu")
        torch.tpu.synchronize()
        _on(state["on_device"], device, "the copy")

    def d2h():
        back = state["on_device"].cpu()
        if not torch.equal(back, host):
            raise AssertionError("the copy back differs from what was sent")

    mib = host.numel() * host.element_size() / 2**20
    return [("eager op", eager, ""), ("fused step", fused, ""), ("compiled step", compiled, ""),
            ("host -> device", h2d, f"{mib:.0f} MiB"), ("device -> host", d2h, f"{mib:.0f} MiB")]


def _check_device(device, label: str) -> bool:
    import jax
    import torch

    ok_all = True
    torch.tpu.set_device(jax.local_devices().index(device))  # "tpu" is this device: tpu:k
    with jax.default_device(device):
        for name, fn, detail in _checks(device):
            _emit(device=label, check=name, start=True)
            try:
                _, first, warm = _timed(fn)
                _emit(device=label, check=name, ok=True, first_ms=first, warm_ms=warm, detail=detail)
            except Exception as exc:  # noqa: BLE001 - each failure is a row
                ok_all = False
                _emit(device=label, check=name, ok=False, first_ms=None, warm_ms=None, detail=_one_line(exc),
                      trace=traceback.format_exc(limit=-4))
    torch.tpu.set_device(0)
    return ok_all


def _local_all_reduce(devices, labels) -> None:
    """Each local device holds its index + 1; a psum over all of them must leave the sum on each."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    _emit(device=labels[0], check="all-reduce (local devices)", start=True)
    n = len(devices)
    mesh = Mesh(np.array(devices), ("local",))
    fn = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "local"), mesh=mesh, in_specs=P("local"),
                               out_specs=P("local")))
    values = np.repeat(np.arange(1, n + 1, dtype=np.float32), 4)
    x = jax.device_put(values, NamedSharding(mesh, P("local")))

    def run():
        out = fn(x)
        out.block_until_ready()
        return out

    try:
        start = time.perf_counter()
        run()
        first = (time.perf_counter() - start) * 1e3
        start = time.perf_counter()
        out = run()
        warm = (time.perf_counter() - start) * 1e3
        shards = {s.device: np.asarray(s.data) for s in out.addressable_shards}
    except Exception as exc:  # noqa: BLE001
        for label in labels:
            _emit(device=label, check="all-reduce (local devices)", ok=False, first_ms=None, warm_ms=None,
                  detail=_one_line(exc))
        return
    want = n * (n + 1) / 2
    for device, label in zip(devices, labels):
        got = shards.get(device)
        ok = got is not None and bool(np.all(got == want))
        _emit(device=label, check="all-reduce (local devices)", ok=ok, first_ms=first, warm_ms=warm,
              detail=f"{n} devices" if ok else f"expected {want}, got {None if got is None else got.tolist()}")


def _rank_all_reduce(label: str) -> None:
    """Under a launcher's job: torch.distributed's all_reduce of a tpu tensor over the ranks."""
    import torch
    import torch.distributed as dist

    _emit(device=label, check="all-reduce (ranks)", start=True)
    try:
        if not dist.is_initialized():
            dist.init_process_group()
        rank, world = dist.get_rank(), dist.get_world_size()

        def run():
            x = torch.full((4,), float(rank + 1), device="tpu")
            dist.all_reduce(x)
            return x

        out, first, warm = _timed(run)
        want = world * (world + 1) / 2
        ok = bool(torch.all(out.cpu() == want))
        _emit(device=label, check=f"all-reduce ({world} ranks)", ok=ok, first_ms=first, warm_ms=warm,
              detail=f"rank {rank} of {world}" if ok else f"expected {want}, got {out.cpu().tolist()}")
    except Exception as exc:  # noqa: BLE001
        _emit(device=label, check="all-reduce (ranks)", ok=False, first_ms=None, warm_ms=None, detail=_one_line(exc))


def main() -> int:
    import torch

    torch.ones(1, device="tpu")  # the device's first op: JAX starts (a launcher's rank joins its job here)
    import jax

    devices = jax.local_devices()
    labels = [f"{d.platform}:{d.id}" for d in devices]
    _emit(platform=devices[0].platform, device_kind=devices[0].device_kind, local_devices=labels,
          process_index=jax.process_index(), process_count=jax.process_count())
    for device, label in zip(devices, labels):
        _check_device(device, label)
    _local_all_reduce(devices, labels)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        _rank_all_reduce(labels[0])
    _emit(done=True)
    return 0


# --- the parent (`tpu-agent doctor --check`): no torch or JAX here ---------------------------------------------
@dataclass
class Report:
    header: dict = field(default_factory=dict)  # platform, device kind, local devices, process index and count
    rows: list[dict] = field(default_factory=list)  # finished checks, in order
    failures: list[str] = field(default_factory=list)  # one line each: "DEVICE: CHECK: why"


def summarize(lines: list[str], returncode: int | None, stderr: str = "") -> Report:
    """The child's JSON lines read back; a check started and never finished (the child crashed or hung) is a
    failure naming its device and check."""
    report, started, done = Report(), None, False
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a stray print of a library
        if "local_devices" in row:
            report.header = row
        elif row.get("done"):
            done = True
        elif row.get("start"):
            started = row
        elif "check" in row:
            report.rows.append(row)
            started = None
            if not row["ok"]:
                report.failures.append(f"{row['device']}: {row['check']}: {row['detail']}")
    if not done:
        tail = next((t for t in reversed(stderr.strip().splitlines()) if t.strip()), "")
        how = "timed out" if returncode is None else f"exit status {returncode}"
        where = f"{started['device']}: {started['check']}" if started else "before its first check"
        report.failures.append(f"{where}: the check process stopped ({how}){': ' + tail if tail else ''}")
    return report


def run(devices: int | None = None, timeout: float = 900) -> Report:
    """The check in a child process (JAX's device count is fixed when it starts): `devices` simulated CPU
    devices where given (TPU_AGENT_DEVICES; a TPU or GPU host checks the chips JAX sees)."""
    env = dict(os.environ)
    if devices is not None:
        env[envvars.DEVICES.name] = str(devices)
    proc = subprocess.Popen([sys.executable, "-m", "tpu_agent.run.device_check"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        code = None
    return summarize(out.splitlines(), code, err)


if __name__ == "__main__":
    sys.exit(main())
