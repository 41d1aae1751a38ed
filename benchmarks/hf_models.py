"""Tiny Hugging Face models on the tpu device: loss agreement with the CPU, per mode.

    .venv/bin/python benchmarks/hf_models.py [--steps 20] [--families gpt2 llama ... | all] [--attentions sdpa eager]

For each family (by default gpt2, llama, vit, resnet, qwen3_moe; `--families all` for every
family of tests/support/hf_models.py, about 10 minutes on 2 cores) and attention implementation
(sdpa by default), trains the same seeded model with
AdamW on the CPU and on tpu in eager, fused, compiled and steps (compiled steps,
no change to the script) modes, and prints a markdown table: the largest relative
difference of a per-step loss from the CPU's. Speed is benchmarks/hf_speed.py's job
(interleaved, as ratios); each mode here trains alone, so its times would not compare.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the support package

from _bench import header  # noqa: E402
from support import hf_models  # noqa: E402

MODES = (*hf_models.MODES, hf_models.STEPS_MODE)
DEFAULT_FAMILIES = ["gpt2", "llama", "vit", "resnet", "qwen3_moe"]  # under 3 minutes on 2 cores


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=hf_models.STEPS)
    parser.add_argument("--families", nargs="*", default=DEFAULT_FAMILIES, choices=[*hf_models.FAMILIES, "all"])
    parser.add_argument("--attentions", nargs="*", default=["sdpa"], choices=["sdpa", "eager"],
                        help="attention implementations, for the families that have both")
    args = parser.parse_args(argv)
    if "all" in args.families:
        args.families = list(hf_models.FAMILIES)
    print(header(f"benchmarks/hf_models.py: loss agreement over {args.steps} AdamW steps"), flush=True)
    print("| family | attention | mode | max rel. loss diff vs CPU | compiled programs |")
    print("|---|---|---|---|---|")
    for name in args.families:
        family = hf_models.FAMILIES[name]
        attns = [a for a in family.attentions if a in args.attentions] or list(family.attentions[:1])
        for attn in (attns if family.attention else (None,)):
            cpu = hf_models.train(name, attn, "cpu", "eager", args.steps)
            for mode in MODES:
                compiled: dict = {}
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    losses = hf_models.train(name, attn, "tpu", mode, args.steps, compiled=compiled)
                diff = max(abs(a - b) / abs(a) for a, b in zip(cpu, losses))
                print(f"| {name} | {attn or '-'} | {mode} | {diff:.1e} | {_programs(mode, compiled)} |", flush=True)
    return 0


def _programs(mode: str, compiled: dict) -> str:
    """How many calls replayed a compiled program (and why not, where one was not)."""
    if mode == "compiled":
        why = compiled.get("reason_not_replayed")
        return f"{compiled.get('replays', 0)} step replays" + (f"; not replayed: {why}" if why else "")
    if mode == hf_models.STEPS_MODE:
        why = [r for r in compiled.get("module_reasons", []) + compiled.get("optimizer_reasons", []) if r]
        return (f"forward {compiled.get('module_replays')}, update {compiled.get('optimizer_replays')} replays"
                + (f"; not compiled: {why}" if why else ""))
    return "-"


if __name__ == "__main__":
    sys.exit(main())
