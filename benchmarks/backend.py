"""Step time of the bundled tpu device, as ratios from one run.

    .venv/bin/python benchmarks/backend.py [--steps 30] [--warmup 5]

Each workload is the model of an example script, trained with its optimizer;
a step ends with a read of the loss (a device sync), as the examples do.
Variants: PyTorch CPU eager (reference), tpu eager (op by op), tpu fused
(DEFER_AND_FUSE), tpu compiled (`torch.compile` of the whole step), and the
same model and optimizer written by hand in JAX (one jitted step). Variants
run in rounds (A B C ...) so machine noise hits them alike; the figure is the
median step time.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn.functional as F

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _torch_step(model, opt, loss_of, mode: str):
    """A training step as the example writes it, run in one of the device's modes."""

    def step():
        opt.zero_grad()
        loss = loss_of(model)
        loss.backward()
        opt.step()
        return loss

    if mode == "compiled":
        compiled = torch.compile(step)
        return lambda: compiled().item()
    if mode == "fused":

        def fused():
            with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
                loss = step()
            return loss.item()

        return fused
    return lambda: step().item()


def mlp_step(variant: str):
    ex = load_example("mlp")
    torch.manual_seed(0)
    x, y = ex.make_data(torch.Generator().manual_seed(0))
    x, y = x[0], y[0]
    model = ex.MLP()
    if variant == "jax":
        return jax_mlp_step(model, x, y)
    device = "cpu" if variant == "cpu eager" else "tpu"
    x, y = x.to(device), y.to(device)
    model = model.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return _torch_step(model, opt, lambda m: F.cross_entropy(m(x), y), variant.split()[-1])


def jax_mlp_step(model, x, y):
    params = {k: jnp.asarray(v.detach().numpy()) for k, v in model.state_dict().items()}
    x, y = jnp.asarray(x.numpy()), jnp.asarray(y.numpy())

    def loss_fn(p):
        h = jax.nn.relu(x @ p["fc1.weight"].T + p["fc1.bias"])
        logits = h @ p["fc2.weight"].T + p["fc2.bias"]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))

    @jax.jit
    def update(p):
        loss, grads = jax.value_and_grad(loss_fn)(p)
        return loss, jax.tree_util.tree_map(lambda w, g: w - 0.1 * g, p, grads)

    state = {"p": params}

    def step():
        loss, state["p"] = update(state["p"])
        return float(loss)

    return step


def transformer_step(variant: str):
    ex = load_example("transformer")
    torch.manual_seed(0)
    tokens = torch.randint(0, ex.VOCAB, (ex.BATCH, ex.SEQ_LEN + 1), generator=torch.Generator().manual_seed(0))
    model = ex.TinyGPT()
    if variant == "jax":
        return jax_transformer_step(ex, model, tokens)
    device = "cpu" if variant == "cpu eager" else "tpu"
    tokens = tokens.to(device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def loss_of(m):
        return F.cross_entropy(m(inputs).reshape(-1, ex.VOCAB), targets.reshape(-1))

    return _torch_step(model, opt, loss_of, variant.split()[-1])


def jax_transformer_step(ex, model, tokens):
    """TinyGPT and AdamW (PyTorch's defaults, weight decay 0.01) written directly in JAX."""
    params = {k: jnp.asarray(v.detach().numpy()) for k, v in model.named_parameters()}
    inputs = jnp.asarray(tokens[:, :-1].numpy())
    targets = jnp.asarray(tokens[:, 1:].numpy())
    mask = jnp.triu(jnp.ones((ex.SEQ_LEN, ex.SEQ_LEN), bool), 1)
    heads, d = ex.N_HEADS, ex.D_MODEL

    def layer_norm(x, w, b):
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return (x - mean) / jnp.sqrt(var + 1e-5) * w + b

    def linear(p, name, x):
        return x @ p[name + ".weight"].T + p[name + ".bias"]

    def loss_fn(p):
        b, t = inputs.shape
        x = p["tok_emb.weight"][inputs] + p["pos_emb.weight"][jnp.arange(t)]
        for i in range(ex.N_LAYERS):
            pre = f"blocks.{i}."
            h = layer_norm(x, p[pre + "ln1.weight"], p[pre + "ln1.bias"])
            q, k, v = jnp.split(linear(p, pre + "attn.qkv", h), 3, axis=-1)
            split = lambda z: z.reshape(b, t, heads, d // heads).transpose(0, 2, 1, 3)  # noqa: E731
            q, k, v = split(q), split(k), split(v)
            scores = jnp.where(mask, -jnp.inf, q @ k.transpose(0, 1, 3, 2) / math.sqrt(d // heads))
            out = (jax.nn.softmax(scores, -1) @ v).transpose(0, 2, 1, 3).reshape(b, t, d)
            x = x + linear(p, pre + "attn.proj", out)
            h = layer_norm(x, p[pre + "ln2.weight"], p[pre + "ln2.bias"])
            x = x + linear(p, pre + "mlp.2", jax.nn.gelu(linear(p, pre + "mlp.0", h), approximate=False))
        x = layer_norm(x, p["ln_f.weight"], p["ln_f.bias"])
        logits = x @ p["tok_emb.weight"].T
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))

    lr, b1, b2, eps, wd = 1e-3, 0.9, 0.999, 1e-8, 0.01

    @jax.jit
    def update(p, m, v, step):
        loss, g = jax.value_and_grad(loss_fn)(p)
        step = step + 1
        m = jax.tree_util.tree_map(lambda m, g: b1 * m + (1 - b1) * g, m, g)
        v = jax.tree_util.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, v, g)
        c1, c2 = 1 - b1**step, 1 - b2**step
        p = jax.tree_util.tree_map(
            lambda p, m, v: p * (1 - lr * wd) - lr * (m / c1) / (jnp.sqrt(v / c2) + eps), p, m, v)
        return loss, p, m, v, step

    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    state = {"s": (params, zeros, zeros, jnp.zeros((), jnp.float32))}

    def step():
        loss, *state["s"] = update(*state["s"])
        return float(loss)

    return step


WORKLOADS = {"mlp": mlp_step, "transformer": transformer_step}
VARIANTS = ["cpu eager", "tpu eager", "tpu fused", "tpu compiled", "jax"]


def measure(build, steps: int, warmup: int) -> dict[str, float]:
    steps_by_variant = {name: build(name) for name in VARIANTS}
    for step in steps_by_variant.values():
        for _ in range(warmup):
            step()
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(steps):
        for name, step in steps_by_variant.items():
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--workloads", nargs="*", default=list(WORKLOADS))
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; median step time (ms) over {args.steps} steps")
    for name in args.workloads:
        ms = measure(WORKLOADS[name], args.steps, args.warmup)
        print(f"\n{name}")
        for variant, t in ms.items():
            print(f"  {variant:13s} {t:9.2f} ms   {t / ms['cpu eager']:6.2f}x cpu eager   {t / ms['jax']:6.2f}x jax")
        print(f"  targets: compiled/jax {ms['tpu compiled'] / ms['jax']:.2f} (<= 1.1), "
              f"fused/compiled {ms['tpu fused'] / ms['tpu compiled']:.2f} (<= 1.5), "
              f"eager/cpu eager {ms['tpu eager'] / ms['cpu eager']:.2f} (<= 5)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
