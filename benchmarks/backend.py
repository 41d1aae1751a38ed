"""Step time of the bundled tpu device, as ratios from one run.

    .venv/bin/python benchmarks/backend.py [--steps 20] [--warmup 6] [--torch-threads N] [--workloads mlp transformer]

Each workload is the model of an example script, trained with its optimizer;
a step ends with a read of the loss (a device sync), as the examples do.
Variants: PyTorch CPU eager (reference), tpu eager (op by op), tpu fused
(DEFER_AND_FUSE), tpu compiled (`torch.compile` of the whole step), tpu steps
(the plain eager step, unchanged, with `torch.tpu.compile_steps()` on while
that model's first steps run: its forward+backward and its optimizer's update
as programs), and the same model and optimizer written by hand in JAX (one
jitted step). Variants run in rounds (A B C ...) so machine noise hits them
alike; the figure is the median step time, a ratio the median of the per-round
ratios. The steps line says how many calls replayed the compiled programs
(0 would mean the variant ran eager).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import torch
import torch.nn.functional as F

from _bench import (StepsReplays, add_threads_option, apply_threads_option, header, interleaved, median_ms,
                    programs_line, programs_per_step, ratio, target)

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load_example(name: str):
    """An example imported as a module, with examples/ on sys.path as `python examples/NAME.py` has it (the
    examples share their loop in examples/training.py)."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
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
    return lambda: step().item()  # eager, and steps: the same code, compile_steps switched on around warm-up


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

    # The state is donated, as a JAX user writes it: XLA updates it in place (on a CPU, no fresh pages per step).
    @functools.partial(jax.jit, donate_argnums=0)
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

    @functools.partial(jax.jit, donate_argnums=(0, 1, 2, 3))
    def update(p, m, v, step):
        loss, g = jax.value_and_grad(loss_fn)(p)
        step = step + 1
        m = jax.tree_util.tree_map(lambda m, g: b1 * m + (1 - b1) * g, m, g)
        v = jax.tree_util.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, v, g)
        c1, c2 = 1 - b1**step, 1 - b2**step
        p = jax.tree_util.tree_map(
            lambda p, m, v: p * (1 - lr * wd) - lr * (m / c1) / (jnp.sqrt(v / c2) + eps), p, m, v)
        return loss, p, m, v, step

    def zeros():  # m and v each their own buffers: both are donated
        return jax.tree_util.tree_map(jnp.zeros_like, params)

    state = {"s": (params, zeros(), zeros(), jnp.zeros((), jnp.float32))}

    def step():
        loss, *state["s"] = update(*state["s"])
        return float(loss)

    return step


WORKLOADS = {"mlp": mlp_step, "transformer": transformer_step}
VARIANTS = ["cpu eager", "tpu eager", "tpu fused", "tpu compiled", "tpu steps", "jax"]
STEPS_WARMUP = 6  # compile_steps: the first optimizer step runs as written, replays start around the 4th


def warm_up(name: str, step, warmup: int) -> None:
    if name != "tpu steps":
        for _ in range(warmup):
            step()
        return
    torch.tpu.compile_steps(True)  # finds the next model called and optimizer stepped: this variant's
    try:
        for _ in range(max(warmup, STEPS_WARMUP)):
            step()
    finally:
        torch.tpu.compile_steps(False)  # what it found stays compiled


def measure(build, steps: int, warmup: int) -> tuple[dict[str, list[float]], str]:
    steps_by_variant = {name: build(name) for name in VARIANTS}
    replays = StepsReplays()
    for name, step in steps_by_variant.items():
        warm_up(name, step, warmup)
    replays.start()
    times = interleaved(steps_by_variant, steps)
    counts = {name: programs_per_step(step) for name, step in steps_by_variant.items() if name.startswith("tpu")}
    return times, replays.note(steps) + "\n" + programs_line(counts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed rounds (one step of each variant per round)")
    parser.add_argument("--warmup", type=int, default=STEPS_WARMUP)
    parser.add_argument("--workloads", nargs="*", default=list(WORKLOADS))
    add_threads_option(parser)
    args = parser.parse_args(argv)
    apply_threads_option(args)
    print(header(f"benchmarks/backend.py: median step time (ms) over {args.steps} interleaved rounds, "
                 f"after {args.warmup} warm-up steps"), flush=True)
    for name in args.workloads:
        t, note = measure(WORKLOADS[name], args.steps, args.warmup)
        print(f"\n{name}")
        for variant in t:
            print(f"  {variant:13s} {median_ms(t[variant]):9.2f} ms   {ratio(t, variant, 'cpu eager'):6.2f}x cpu eager"
                  f"   {ratio(t, variant, 'jax'):6.2f}x jax")
        print(note)
        print("  targets: " + ", ".join([
            target("compiled/jax", ratio(t, "tpu compiled", "jax"), "<=", 1.1),
            target("steps/compiled", ratio(t, "tpu steps", "tpu compiled"), "<=", 1.1),
            target("steps/fused", ratio(t, "tpu steps", "tpu fused"), "<", 1),
            target("fused/compiled", ratio(t, "tpu fused", "tpu compiled"), "<=", 1.5),
            target("eager/fused", ratio(t, "tpu eager", "tpu fused"), ">=", 1.5),
            target("eager/cpu eager", ratio(t, "tpu eager", "cpu eager"), "<=", 5),
        ]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
