"""How far the `tpu` device's losses drift from the CPU's over 20 AdamW steps of a Llama off every tile.

`--size small`: hidden 72, intermediate 200, vocabulary 1001, 6 query heads over one key/value head.
`--size large`: hidden 200, intermediate 3000, vocabulary 32001, 5 query heads over one key/value head.
Pad token 0, a 4 x 48 batch with one row right-padded by 20 (random ids, so some real tokens may share the
pad token's id). Prints the relative loss difference at step 15 and its maximum:

    python benchmarks/unaligned_gqa_drift.py [--mode eager|fused|steps|compiled] [--fused-adamw] [--layers 2]
        [--size small|large]

`steps` is compiled steps with no script change (TPU_AGENT_COMPILE_STEPS); `compiled` is torch.compile(step).
"""

from __future__ import annotations

import argparse
import warnings

import torch

MODES = ("eager", "fused", "steps", "compiled")
STEPS = 20
# name -> (vocabulary, hidden, intermediate, query heads)
SIZES = {"small": (1001, 72, 200, 6), "large": (32001, 200, 3000, 5)}


def batch(vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (4, 48), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 28:] = 0
    ids[1, 28:] = 0
    labels = ids.clone()
    labels[mask == 0] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def train(device: str, mode: str, fused_adamw: bool, layers: int, size: str) -> list[float]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from tpu_agent.backend.compiled import auto_compile

    vocab, hidden, intermediate, heads = SIZES[size]
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=1, max_position_embeddings=64, pad_token_id=0,
                      attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).train().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused_adamw or None)
    inputs = {k: v.to(device) for k, v in batch(vocab).items()}

    def step():
        loss = model(**inputs).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    on_tpu = device == "tpu"
    if on_tpu and mode == "compiled":
        step = torch.compile(step)
    if on_tpu and mode == "fused":
        torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE)
    if on_tpu and mode == "steps":
        auto_compile.compile_steps(True)
    try:
        return [step().item() for _ in range(STEPS)]
    finally:
        if on_tpu:
            auto_compile.compile_steps(False)
            torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_NEVER)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=MODES, default="steps")
    parser.add_argument("--fused-adamw", action="store_true", help="AdamW(fused=True) on both devices")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--size", choices=tuple(SIZES), default="small")
    args = parser.parse_args()
    if args.layers < 1:
        parser.error("--layers must be at least 1")
    import tpu_agent.backend  # noqa: F401 - the tpu device

    warnings.simplefilter("ignore")  # a step that cannot be one program says so; not the point here
    cpu = train("cpu", "eager", args.fused_adamw, args.layers, args.size)
    tpu = train("tpu", args.mode, args.fused_adamw, args.layers, args.size)
    rel = [abs(a - b) / abs(a) for a, b in zip(cpu, tpu)]
    worst = max(range(STEPS), key=rel.__getitem__)
    print(f"{args.size}, {args.mode}{' fused AdamW' if args.fused_adamw else ''}, {args.layers} layers: loss drift from the CPU "
          f"{rel[15]:.2e} at step 15, {rel[worst]:.2e} at most (step {worst}); "
          f"cpu {cpu[0]:.4f} -> {cpu[-1]:.4f}")


if __name__ == "__main__":
    main()
