"""The GPT-2 vocabulary on the `tpu` device: padded in the backend (exact) or in the config (a model change).

examples/hf_gpt2.py's model (a tiny GPT-2, vocab 50257, 8 x 64 tokens, AdamW) built once per variant in one
process, steps interleaved (A B C ... A B C ...), median step time per variant and its ratio to the unpadded
model in the same execution mode:

    python benchmarks/hf_vocab.py [--mode fused|eager] [--rounds 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from tpu_agent.backend.core import padding

VARIANTS = {  # name -> (vocab_size, backend padding (multiple, sizes) or None)
    "vocab 50257": (50257, None),
    "vocab 50257, pad_ops 256 on 50257 (exact)": (50257, (256, (50257,))),
    "vocab 50257, pad_ops 128 on 50257 (exact)": (50257, (128, (50257,))),
    "vocab 50304 (model)": (50304, None),
    "vocab 50432 (model)": (50432, None),
}


def make_step(vocab: int, embd: int, batch: int):
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=vocab, n_positions=64, n_embd=embd, n_layer=2, n_head=4)
    model = GPT2LMHeadModel(config).to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 50257, (batch, 64), generator=torch.Generator().manual_seed(1)).to("tpu")

    def step() -> float:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()  # a sync: the step's time is its execution

    return step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["eager", "fused"], default="fused")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--embd", type=int, default=64, help="n_embd (the example's: 64)")
    parser.add_argument("--batch", type=int, default=8, help="sequences of 64 tokens (the example's: 8)")
    args = parser.parse_args()
    if args.mode == "fused":
        torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE)
    steps = {name: make_step(vocab, args.embd, args.batch) for name, (vocab, _) in VARIANTS.items()}

    def run(name):
        pad = VARIANTS[name][1]
        padding.set_multiple(*(pad or (0,)))
        t = time.perf_counter()
        steps[name]()
        padding.set_multiple(0)
        return time.perf_counter() - t

    for name in steps:  # warm-up: compilation
        for _ in range(3):
            run(name)
    times = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name in steps:
            times[name].append(run(name))
    base = statistics.median(times["vocab 50257"])
    print(f"mode {args.mode}, n_embd {args.embd}, batch {args.batch} x 64, {args.rounds} interleaved rounds; "
          "ratio = unpadded median / variant median")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"  {name:45s} {m * 1e3:8.1f} ms  {base / m:.3f}x")


if __name__ == "__main__":
    main()
