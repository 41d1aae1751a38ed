"""Buffers that a forward writes in place, on tpu as on the CPU: BatchNorm's and InstanceNorm's running statistics
(momentum, momentum=None's cumulative average, the unbiased variance, num_batches_tracked), in eager and fused
mode, as compiled steps, under autocast and under torch.compile; and a small ResNet-style BatchNorm CNN trained a
few steps on both devices with the same batches, whose evaluation (outputs, loss, accuracy) must then agree.

`native_batch_norm`'s schema does not mark running_mean / running_var as written, though PyTorch's kernels update
them in training: the device once dropped the new values, and only the losses were compared, which training
mode's batch statistics keep equal.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

MODES = ["eager", "fused", "steps"]


@contextlib.contextmanager
def _mode(mode: str, device: str):
    if device != "tpu" or mode == "eager":
        yield
        return
    if mode == "fused":
        with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
            yield
        return
    from tpu_agent.backend.compiled import auto_compile

    auto_compile.compile_steps(True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        auto_compile.compile_steps(False)


def _buffers(module) -> dict:
    return {k: v.detach().cpu() for k, v in module.state_dict().items()}


def _assert_buffers(actual: dict, expected: dict, label: str, rtol=1.3e-6, atol=1e-6):
    assert actual.keys() == expected.keys()
    for k, e in expected.items():
        torch.testing.assert_close(actual[k], e, rtol=rtol, atol=atol, msg=lambda m: f"{label} {k}: {m}")


# --------------------------------------------------------------------------
# one norm layer at a time
# --------------------------------------------------------------------------

LAYERS = {
    "BatchNorm1d": (lambda: nn.BatchNorm1d(3), (6, 3)),
    "BatchNorm1d-seq": (lambda: nn.BatchNorm1d(3), (4, 3, 5)),
    "BatchNorm2d": (lambda: nn.BatchNorm2d(3), (4, 3, 5, 5)),
    "BatchNorm3d": (lambda: nn.BatchNorm3d(2, momentum=0.3), (2, 2, 3, 4, 3)),
    "BatchNorm2d-momentum-None": (lambda: nn.BatchNorm2d(3, momentum=None), (4, 3, 5, 5)),
    "BatchNorm2d-no-affine": (lambda: nn.BatchNorm2d(3, affine=False), (4, 3, 5, 5)),
    "SyncBatchNorm": (lambda: nn.SyncBatchNorm(3), (4, 3, 5, 5)),  # one process: PyTorch's F.batch_norm path
    "InstanceNorm1d-tracked": (lambda: nn.InstanceNorm1d(3, track_running_stats=True), (4, 3, 7)),
    "InstanceNorm2d-tracked": (lambda: nn.InstanceNorm2d(3, affine=True, track_running_stats=True), (4, 3, 5, 5)),
    "InstanceNorm3d-tracked": (lambda: nn.InstanceNorm3d(2, momentum=0.2, track_running_stats=True), (2, 2, 3, 4, 3)),
}


def _norm_steps(name: str, device: str, mode: str, steps: int = 3):
    make, shape = LAYERS[name]
    torch.manual_seed(0)
    layer = make().to(device)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(*shape, generator=g) * 2 + 0.5 for _ in range(steps + 1)]
    outs = []
    with _mode(mode, device):
        for x in batches[:steps]:
            outs.append(layer(x.to(device)).detach().cpu())
    layer.eval()
    with torch.no_grad():
        outs.append(layer(batches[-1].to(device)).cpu())
    return outs, _buffers(layer)


@pytest.mark.parametrize("mode", ["eager", "fused"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_running_statistics_follow_the_cpus(name, mode):
    cpu_outs, cpu_buffers = _norm_steps(name, "cpu", mode)
    tpu_outs, tpu_buffers = _norm_steps(name, "tpu", mode)
    if "running_mean" in cpu_buffers:  # the check can fail: the statistics moved from their initial values
        assert not torch.equal(cpu_buffers["running_mean"], torch.zeros_like(cpu_buffers["running_mean"]))
        assert int(cpu_buffers["num_batches_tracked"]) == (3 if "Batch" in name else 0)  # InstanceNorm's stays 0
    _assert_buffers(tpu_buffers, cpu_buffers, f"{name} ({mode})")
    for i, (a, e) in enumerate(zip(tpu_outs, cpu_outs)):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name} output {i} ({mode}): {m}")


def test_the_functional_batch_norm_updates_the_tensors_it_is_given():
    """F.batch_norm with running tensors of the caller's: the writes reach those tensors, views included."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(8, 4, 3, generator=g)
    stats = torch.stack([torch.zeros(4), torch.ones(4)])  # running mean and var as rows of one tensor
    results = {}
    for device in ("cpu", "tpu"):
        s = stats.clone().to(device)
        out = F.batch_norm(x.to(device), s[0], s[1], training=True, momentum=0.25)
        results[device] = (out.cpu(), s.cpu())
    torch.testing.assert_close(results["tpu"][1], results["cpu"][1], rtol=1.3e-6, atol=1e-6)
    torch.testing.assert_close(results["tpu"][0], results["cpu"][0])
    assert not torch.equal(results["cpu"][1], stats)


def test_batch_norm_update_stats_updates_its_running_tensors():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 3, 4, generator=g)
    results = {}
    for device in ("cpu", "tpu"):
        rm, rv = torch.zeros(3, device=device), torch.ones(3, device=device)
        mean, var = torch.batch_norm_update_stats(x.to(device), rm, rv, 0.2)
        results[device] = [t.cpu() for t in (mean, var, rm, rv)]
    for a, e in zip(results["tpu"], results["cpu"]):
        torch.testing.assert_close(a, e, rtol=1.3e-6, atol=1e-6)


def test_running_statistics_under_autocast():
    """bfloat16 autocast: the convolution runs in bfloat16, batch norm keeps float32 statistics (as on the CPU)."""
    results = {}
    for device in ("cpu", "tpu"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).to(device)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            with torch.autocast(device, dtype=torch.bfloat16):
                out = model(torch.randn(4, 3, 8, 8, generator=g).to(device))
        results[device] = (_buffers(model), out.dtype)
    assert results["tpu"][1] == results["cpu"][1]
    cpu = results["cpu"][0]
    assert cpu["1.running_mean"].dtype == torch.float32 and cpu["1.running_mean"].abs().sum() > 0
    # The same bfloat16 convolution on both devices, each summing in its own order: statistics of bfloat16
    # activations agree to bfloat16's resolution.
    _assert_buffers(results["tpu"][0], cpu, "autocast", rtol=1e-2, atol=1e-2)


def test_running_statistics_under_torch_compile():
    results = {}
    for device in ("cpu", "tpu"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
        model.to(device)
        step = torch.compile(model, backend="tpu" if device == "tpu" else "eager")
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            out = step(torch.randn(4, 3, 8, 8, generator=g).to(device))
        results[device] = (_buffers(model), out.detach().cpu())
    _assert_buffers(results["tpu"][0], results["cpu"][0], "torch.compile")
    torch.testing.assert_close(results["tpu"][1], results["cpu"][1], rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------
# a ResNet-style CNN: train on both devices, evaluate on both
# --------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                      if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.short(x))


class ResNet(nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.layers = nn.Sequential(Block(8, 8, 1), Block(8, 16, 2))
        self.head = nn.Linear(16, classes)

    def forward(self, x):
        return self.head(torch.flatten(F.adaptive_avg_pool2d(self.layers(self.stem(x)), 1), 1))


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 12, 12, generator=g) * 1.5 + 0.3, torch.randint(0, 10, (n,), generator=g)


def _resnet(device: str, mode: str, steps: int = 6):
    torch.manual_seed(0)
    model = ResNet().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    batches = [_data(16, 10 + i) for i in range(steps)]
    losses = []
    with _mode(mode, device):
        for x, y in batches:
            loss = F.cross_entropy(model(x.to(device)), y.to(device))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    model.eval()
    x, y = _data(32, 99)
    with torch.no_grad():
        logits = model(x.to(device)).cpu()
    return losses, _buffers(model), logits, F.cross_entropy(logits, y).item(), (logits.argmax(1) == y).float().mean().item()


_CPU_RESNET = {}


@pytest.mark.parametrize("mode", MODES)
def test_a_batchnorm_resnet_evaluates_as_on_the_cpu(mode):
    if "cpu" not in _CPU_RESNET:
        _CPU_RESNET["cpu"] = _resnet("cpu", "eager")
    losses, buffers, logits, val_loss, accuracy = _resnet("tpu", mode)
    cpu_losses, cpu_buffers, cpu_logits, cpu_val_loss, cpu_accuracy = _CPU_RESNET["cpu"]
    assert losses == pytest.approx(cpu_losses, rel=1e-5, abs=1e-6)
    running = [k for k in cpu_buffers if k.endswith("running_mean")]
    assert len(running) == 6 and all(cpu_buffers[k].abs().sum() > 0 for k in running)
    _assert_buffers({k: v for k, v in buffers.items() if "running" in k or "tracked" in k},
                    {k: v for k, v in cpu_buffers.items() if "running" in k or "tracked" in k},
                    f"resnet ({mode})", rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(logits, cpu_logits, rtol=1e-4, atol=1e-4)
    assert val_loss == pytest.approx(cpu_val_loss, rel=1e-5)
    assert accuracy == cpu_accuracy


def test_a_cpu_tensor_written_after_it_was_moved_leaves_the_device_copy_alone():
    """`.to("tpu")` copies, as on any device: JAX's CPU client could alias the CPU tensor's memory, and then a
    running statistic updated on the CPU after the move changed the tpu tensor too."""
    for dtype in (torch.float32, torch.bfloat16):
        cpu = torch.zeros(5, dtype=dtype)
        moved = cpu.to("tpu")
        cpu.add_(1)
        assert torch.equal(moved.cpu(), torch.zeros(5, dtype=dtype))


def _small_steps(device: str, mode: str):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, momentum=None), nn.Flatten(),
                          nn.Linear(4 * 6 * 6, 3)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    losses = []
    with _mode(mode, device):
        for _ in range(5):
            x, y = torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 3, (4,), generator=g)
            loss = F.cross_entropy(model(x.to(device)), y.to(device))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return losses, _buffers(model)


def test_the_cumulative_average_under_compiled_steps():
    """momentum=None reads num_batches_tracked on the host each step (1 / n); the steps that capture the module's
    forward run it twice (capture, then the program), and its running statistics must move once."""
    cpu_losses, cpu_buffers = _small_steps("cpu", "eager")
    losses, buffers = _small_steps("tpu", "steps")
    assert losses == pytest.approx(cpu_losses, rel=1e-5)
    assert int(cpu_buffers["1.num_batches_tracked"]) == 5
    _assert_buffers(buffers, cpu_buffers, "momentum=None, compiled steps", rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("with_counts", [True, False], ids=["gather_stats_with_counts", "gather_stats"])
def test_sync_batchnorm_ops_over_two_simulated_ranks_match_batchnorm_over_the_whole_batch(with_counts):
    """SyncBatchNorm's op chain (PyTorch has it for CUDA only), two ranks' halves of one batch in one process:
    the gathered statistics, the running statistics' update and the normalisation, then the backward's reduce and
    elementwise halves, against F.batch_norm over the whole batch on the CPU and its autograd gradients."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(8, 3, 5, generator=g) * 2 + 1
    weight, bias = torch.rand(3, generator=g) + 0.5, torch.randn(3, generator=g)
    dy = torch.randn(8, 3, 5, generator=g)
    eps, momentum = 1e-5, 0.3
    rm, rv = torch.zeros(3), torch.ones(3)
    xc = x.clone().requires_grad_()
    out = F.batch_norm(xc, rm, rv, weight, bias, training=True, momentum=momentum, eps=eps)
    out.backward(dy)

    t = lambda v: v.to("tpu")  # noqa: E731
    halves = [t(h) for h in x.chunk(2)]
    stats = [torch.batch_norm_stats(h, eps) for h in halves]
    mean_all, invstd_all = torch.stack([s[0] for s in stats]), torch.stack([s[1] for s in stats])
    trm, trv = t(torch.zeros(3)), t(torch.ones(3))
    if with_counts:
        mean, invstd = torch.batch_norm_gather_stats_with_counts(halves[0], mean_all, invstd_all, trm, trv, momentum,
                                                                 eps, t(torch.tensor([20.0, 20.0])))
    else:
        mean, invstd = torch.batch_norm_gather_stats(halves[0], mean_all, invstd_all, trm, trv, momentum, eps, 4 * 5)
    outs = [torch.batch_norm_elemt(h, t(weight), t(bias), mean, invstd, eps) for h in halves]
    torch.testing.assert_close(torch.cat([o.cpu() for o in outs]), out.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(trm.cpu(), rm, rtol=1.3e-6, atol=1e-6)
    torch.testing.assert_close(trv.cpu(), rv, rtol=1.3e-6, atol=1e-6)

    dys = [t(d) for d in dy.chunk(2)]
    reduced = [torch.batch_norm_backward_reduce(d, h, mean, invstd, t(weight), True, True, True)
               for d, h in zip(dys, halves)]
    sum_dy = reduced[0][0] + reduced[1][0]  # what the all-reduce sums
    sum_dy_xmu = reduced[0][1] + reduced[1][1]
    count = t(torch.tensor([20, 20], dtype=torch.int32))
    grads = [torch.batch_norm_backward_elemt(d, h, mean, invstd, t(weight), sum_dy, sum_dy_xmu, count)
             for d, h in zip(dys, halves)]
    torch.testing.assert_close(torch.cat([gr.cpu() for gr in grads]), xc.grad, rtol=1e-5, atol=1e-5)
    # DDP all-reduces the parameters' gradients: their sum over the ranks is the whole batch's.
    dw = reduced[0][2].cpu() + reduced[1][2].cpu()
    db = reduced[0][3].cpu() + reduced[1][3].cpu()
    w, b = weight.clone().requires_grad_(), bias.clone().requires_grad_()
    F.batch_norm(x, None, None, w, b, training=True, eps=eps).backward(dy)
    torch.testing.assert_close(dw, w.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(db, b.grad, rtol=1e-5, atol=1e-5)


def test_running_statistics_under_a_torch_compiled_training_step():
    """torch.compile of a whole step (forward, backward, optimizer.step): replayed once captured, its running
    statistics written by the step's one program each call, as the CPU's eager steps write them."""
    results = {}
    for device in ("cpu", "tpu"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(144, 2))
        model.to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step(x, y):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            return loss

        run = torch.compile(step) if device == "tpu" else step
        g = torch.Generator().manual_seed(1)
        losses = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(5):  # the capture, then replays
                x, y = torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 2, (4,), generator=g)
                losses.append(run(x.to(device), y.to(device)).item())
        results[device] = (_buffers(model), losses)
    assert results["cpu"][0]["1.num_batches_tracked"].item() == 5
    _assert_buffers(results["tpu"][0], results["cpu"][0], "torch.compile(step)", rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results["tpu"][1], results["cpu"][1], rtol=1e-5, atol=1e-6)
