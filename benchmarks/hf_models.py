"""Tiny Hugging Face models on the tpu device: loss agreement with the CPU, per mode.

    .venv/bin/python benchmarks/hf_models.py [--steps 20] [--families gpt2 llama ...]

For each family and attention implementation, trains the same seeded model with
AdamW on the CPU and on tpu in eager, fused and compiled modes, and prints a
markdown table: the largest relative difference of a per-step loss from the
CPU's, and the median step time after the first two steps (compilation
included there; these models are tiny, so the times say more about per-op
overhead than about the math).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the support package

from support import hf_models  # noqa: E402


def timed_train(family, attn, device, mode, steps):
    times = []
    losses = hf_models.train(family, attn, device, mode, steps, times=times)
    return losses, times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=hf_models.STEPS)
    parser.add_argument("--families", nargs="*", default=list(hf_models.FAMILIES))
    args = parser.parse_args()
    print("| family | attention | mode | max rel. loss diff vs CPU | median step (ms), tpu | CPU eager (ms) |")
    print("|---|---|---|---|---|---|")
    for name in args.families:
        family = hf_models.FAMILIES[name]
        for attn in (("sdpa", "eager") if family.attention else (None,)):
            cpu, cpu_times = timed_train(name, attn, "cpu", "eager", args.steps)
            for mode in hf_models.MODES:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    losses, times = timed_train(name, attn, "tpu", mode, args.steps)
                diff = max(abs(a - b) / abs(a) for a, b in zip(cpu, losses))
                print(f"| {name} | {attn or '-'} | {mode} | {diff:.1e} | {statistics.median(times[2:]) * 1e3:.1f} "
                      f"| {statistics.median(cpu_times[2:]) * 1e3:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
