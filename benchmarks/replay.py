"""The host's cost per step of compiled steps, against torch.compile(step) and PyTorch CPU eager, as ratios from one run.

    .venv/bin/python benchmarks/replay.py [--models gpt2_deep gpt2 vit llama] [--rounds 4] [--block 5]
                                          [--warmup 8] [--torch-threads N] [--quick]

Models, built here from transformers configs (random weights, nothing downloaded):
gpt2_deep (GPT-2, 24 layers x 64 wide, vocabulary 512, 4 x 32 tokens: a real model's op count, tiny math),
gpt2 (2 layers x 32, GPT-2's 50257 vocabulary), vit and llama (2 layers x 32).

The step is an unchanged training loop's:

    loss = model(**batch).loss; loss.backward(); clip_grad_norm_(model.parameters(), 1.0)
    opt.step(); opt.zero_grad()          # AdamW

and each timed call synchronizes the device after it (the loss read). Variants: cpu eager (the reference),
tpu eager (op by op), tpu fused (DEFER_AND_FUSE), tpu steps (compiled steps: `torch.tpu.compile_steps()`, no
change to the script) and tpu compiled (`torch.compile(step)`, the loss read outside it). They run in rounds
of blocks (A B C ..., the order reversed every other round; _bench.in_blocks); ratios are medians of per-round
ratios. For compiled steps and torch.compile(step) it also gives the host thread's CPU time per step
(`time.thread_time()` around the step's Python, the device synchronized outside it), and for compiled steps
the first step's time, the number of steps until compiling stops (the last warm-up step that made a new
XLA executable) and those steps' seconds. On a loaded 2-core machine pass --torch-threads 1: two PyTorch threads
fighting other processes made CPU eager tens of times slower. Targets (issue point 2): steps/compiled <= 1.1 on every model; gpt2_deep steps/cpu <= 0.35;
gpt2_deep host CPU per step <= 2 ms. Prints versions, date, load and commit with the table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

from _bench import add_threads_option, apply_threads_option, header, in_blocks, median_ms, ratio, target

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ["cpu eager", "tpu eager", "tpu fused", "tpu steps", "tpu compiled"]
LR = 1e-3


def _ids(vocab: int, batch: int, seq: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))


def gpt2_deep():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=512, n_embd=64, n_layer=24, n_head=4, n_positions=64, bos_token_id=0,
                     eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, loss_type="ForCausalLM")
    ids = _ids(512, 4, 32)
    return GPT2LMHeadModel, cfg, {"input_ids": ids, "labels": ids}


def gpt2_quick():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=2, n_positions=32, bos_token_id=0,
                     eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, loss_type="ForCausalLM")
    ids = _ids(128, 2, 8)
    return GPT2LMHeadModel, cfg, {"input_ids": ids, "labels": ids}


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=50257, n_embd=32, n_layer=2, n_head=2, n_positions=32,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ids = _ids(50257, 2, 16)
    return GPT2LMHeadModel, cfg, {"input_ids": ids, "labels": ids}


def vit():
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                    num_attention_heads=4, intermediate_size=64, num_labels=10,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    pixels = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    return ViTForImageClassification, cfg, {"pixel_values": pixels, "labels": torch.tensor([1, 5, 7, 2])}


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    ids = _ids(128, 2, 12)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 8:] = 0
    ids[1, 8:] = 0
    labels = ids.clone()
    labels[mask == 0] = -100
    return LlamaForCausalLM, cfg, {"input_ids": ids, "attention_mask": mask, "labels": labels}


MODELS = {"gpt2_deep": gpt2_deep, "gpt2": gpt2, "vit": vit, "llama": llama, "gpt2_quick": gpt2_quick}


def build(name: str, device: str):
    cls, cfg, inputs = MODELS[name]()
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = cls(cfg).train().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    return model, opt, {k: v.to(device) for k, v in inputs.items()}


class Variant:
    """One variant's step (synchronized after it), with the host thread's CPU time of its Python."""

    def __init__(self, name: str, model_name: str) -> None:
        self.name = name
        model, opt, batch = build(model_name, "cpu" if name == "cpu eager" else "tpu")

        def body():
            loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            return loss.detach()

        self.body = torch.compile(body) if name == "tpu compiled" else body
        self.thread_s: list[float] = []

    def __call__(self) -> float:
        t0 = time.thread_time()
        if self.name == "tpu fused":
            with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
                loss = self.body()
        else:
            loss = self.body()
        self.thread_s.append(time.thread_time() - t0)
        return loss.item()  # the device synchronized outside the thread time


def warm_up(variant: Variant, steps: int) -> tuple[float, int, float]:
    """The first step's seconds, the steps until compiling stopped (the last step that made a new executable)
    and the seconds those steps took, over `steps` warm-up steps."""
    from tpu_agent.backend.core import executables

    took, last_new = [], 0
    for i in range(steps):
        before = len(executables.all())
        t0 = time.perf_counter()
        variant()
        took.append(time.perf_counter() - t0)
        if len(executables.all()) > before:
            last_new = i + 1
    return took[0], last_new, sum(took[:last_new])


def measure(model_name: str, rounds: int, block: int, warmup: int, variants: list[str]):
    steps, warm = {}, {}
    from tpu_agent.backend.compiled import auto_compile

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in variants:
            steps[name] = Variant(name, model_name)
            if name == "tpu steps":
                found = len(auto_compile.STATE.modules), len(auto_compile.STATE.optimizers)
                torch.tpu.compile_steps(True)  # finds the next model called and optimizer stepped: this one
            try:
                warm[name] = warm_up(steps[name], warmup)
            finally:
                if name == "tpu steps":
                    torch.tpu.compile_steps(False)  # what it found stays compiled
            if name == "tpu steps":
                # compile_steps(False) thawed the garbage collector's objects; two steps that compile nothing freeze
                # them again (one collection first, ~0.3 s on gpt2_deep): warm-up, not a timed step.
                for _ in range(3):
                    steps[name]()
            steps[name].thread_s.clear()
        modules = auto_compile.STATE.modules[found[0]:] if "tpu steps" in variants else []
        optimizers = auto_compile.STATE.optimizers[found[1]:] if "tpu steps" in variants else []
        before = [m.replays for m in modules], [o.replays for o in optimizers]
        times = in_blocks(steps, rounds, block)
        replays = ([m.replays - b for m, b in zip(modules, before[0])],
                   [o.replays - b for o, b in zip(optimizers, before[1])])
    return times, steps, warm, replays


def commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "backend", "benchmarks"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return out.stdout.strip() + (" (backend/benchmarks modified)" if dirty else "")
    except OSError:
        return "unknown"


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=None, choices=list(MODELS))
    parser.add_argument("--variants", nargs="*", default=VARIANTS, choices=VARIANTS)
    parser.add_argument("--rounds", type=int, default=4, help="rounds (a block of steps of each variant per round)")
    parser.add_argument("--block", type=int, default=5, help="timed steps of a variant in a row, per round")
    parser.add_argument("--warmup", type=int, default=8, help="warm-up steps per variant (compiling)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: a 2-layer GPT-2, 1 round of 1 step")
    add_threads_option(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.models = args.models or ["gpt2_quick"]
        args.rounds, args.block, args.warmup = 1, 1, min(args.warmup, 6)
    models = args.models or ["gpt2_deep", "gpt2", "vit", "llama"]
    variants = [v for v in VARIANTS if v in args.variants]
    apply_threads_option(args)
    print(header(f"benchmarks/replay.py: median ms per step over {args.rounds} rounds of {args.block}-step blocks "
                 f"per variant, after {args.warmup} warm-up steps"))
    print(f"commit {commit()}  load {load()} before  command: {' '.join(['benchmarks/replay.py', *sys.argv[1:]])}",
          flush=True)
    cols = "".join(f"{v:>14}" for v in variants)
    print(f"\n{'model':11}{cols}{'steps host':>12}{'compiled host':>15}{'first step':>12}{'compiling':>11}"
          f"{'until then':>12}")
    notes = []
    for name in models:
        times, steps, warm, replays = measure(name, args.rounds, args.block, args.warmup, variants)
        host = {v: statistics.median(steps[v].thread_s) * 1e3 for v in ("tpu steps", "tpu compiled") if v in steps}
        row = "".join(f"{median_ms(times[v]):14.2f}" for v in variants)
        first, stops, until = warm.get("tpu steps", (float("nan"), 0, float("nan")))
        print(f"{name:11}{row}{host.get('tpu steps', float('nan')):12.2f}{host.get('tpu compiled', float('nan')):15.2f}"
              f"{first:11.1f}s{stops:>11}{until:11.1f}s", flush=True)
        parts = []
        if "tpu steps" in variants and "tpu compiled" in variants:
            parts.append(target("steps/compiled", ratio(times, "tpu steps", "tpu compiled"), "<=", 1.1))
        if "tpu steps" in variants and "cpu eager" in variants:
            bound = 0.35 if name == "gpt2_deep" else None
            value = ratio(times, "tpu steps", "cpu eager")
            parts.append(target("steps/cpu", value, "<=", bound) if bound else f"steps/cpu {value:.2f}")
        if "tpu steps" in host and name == "gpt2_deep":
            parts.append(target("steps host ms", host["tpu steps"], "<=", 2.0))
        notes.append(f"  {name}: " + ", ".join(parts) + f"; replays in the timed rounds: forward {replays[0]}, "
                     f"update {replays[1]}")
    print("\n".join(["", *notes]))
    print(f"\nload {load()} after; steps host / compiled host: the host thread's CPU ms per step (thread_time); "
          "first step, compiling (steps until no new executable) and until then (their seconds): compiled steps' "
          "warm-up")
    return 0


if __name__ == "__main__":
    sys.exit(main())
