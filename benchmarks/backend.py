"""Step time of the bundled tpu device against PyTorch CPU eager, as ratios from one run.

    .venv/bin/python benchmarks/backend.py [--steps 30] [--warmup 5]

Each workload is the model of an example script, trained with its optimizer;
a step ends with `loss.item()` (a device sync), as the examples do. Variants
run in rounds (A B A B ...) so machine noise hits them alike; the figure is
the median step time.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def mlp_step(device: str):
    ex = load_example("mlp")
    torch.manual_seed(0)
    x, y = ex.make_data(torch.Generator().manual_seed(0))
    x, y = x[0].to(device), y[0].to(device)
    model = ex.MLP().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step():
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    return step


def transformer_step(device: str):
    ex = load_example("transformer")
    torch.manual_seed(0)
    tokens = torch.randint(0, ex.VOCAB, (ex.BATCH, ex.SEQ_LEN + 1), generator=torch.Generator().manual_seed(0))
    tokens = tokens.to(device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    model = ex.TinyGPT().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step():
        opt.zero_grad()
        logits = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, ex.VOCAB), targets.reshape(-1))
        loss.backward()
        opt.step()
        return loss.item()

    return step


WORKLOADS = {"mlp": mlp_step, "transformer": transformer_step}
VARIANTS = {"cpu eager": "cpu", "tpu eager": "tpu"}


def measure(build, steps: int, warmup: int) -> dict[str, float]:
    steps_by_variant = {name: build(device) for name, device in VARIANTS.items()}
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
        ref = ms["cpu eager"]
        cells = "  ".join(f"{v}: {t:8.2f} ms ({t / ref:5.2f}x cpu eager)" for v, t in ms.items())
        print(f"{name:12s} {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
