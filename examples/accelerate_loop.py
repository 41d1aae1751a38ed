"""A training loop written for Hugging Face Accelerate: a tiny Llama from a config, token data made here.

Nothing names a device: `Accelerator()` picks it. Under plain `python` that is the CPU; under
`tpu-agent run` it is `tpu`, with no change to the script. Gradient accumulation, clipping, an eval
pass gathered with `gather_for_metrics`, and `save_state` / `load_state` halfway (`--resume` carries on
from the saved state), as an Accelerate script usually has them.

    python examples/accelerate_loop.py --steps 8
    tpu-agent run examples/accelerate_loop.py -- --steps 8
"""

import argparse
import os

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 256
SEQ_LEN = 32


def token_data(n: int, seed: int) -> TensorDataset:
    """Sequences with a pattern to learn: each token follows from the one before."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    step = torch.randint(1, 4, (n, 1), generator=g)
    return TensorDataset((start + step * torch.arange(SEQ_LEN)) % VOCAB)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--output-dir", default="accelerate_out")
    parser.add_argument("--resume", action="store_true", help="load the state saved halfway and carry on")
    args = parser.parse_args()

    accelerator = Accelerator(gradient_accumulation_steps=2)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ_LEN)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 2))
    train = DataLoader(token_data(4 * 2 * args.steps, seed=1), batch_size=4, shuffle=False)
    evaluation = DataLoader(token_data(16, seed=2), batch_size=8)
    model, optimizer, train, evaluation, scheduler = accelerator.prepare(model, optimizer, train, evaluation,
                                                                         scheduler)
    state_dir = os.path.join(args.output_dir, "state")
    half = args.steps // 2
    first = 0
    if args.resume:
        accelerator.load_state(state_dir)
        first = half

    step = 0
    for i, (ids,) in enumerate(train):
        if i < 2 * first:  # batches the saved run already trained on
            continue
        with accelerator.accumulate(model):
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            step = first + (i - 2 * first) // 2 + 1
            accelerator.print(f"step={step} loss={loss.item():.6f}")
            if step == half and not args.resume:
                accelerator.save_state(state_dir)

    model.eval()
    losses = []
    for (ids,) in evaluation:
        with torch.no_grad():
            loss = model(input_ids=ids, labels=ids).loss
        losses.append(accelerator.gather_for_metrics(loss.repeat(len(ids))))
    accelerator.print(f"device={accelerator.device.type}")
    accelerator.print(f"step={step} eval_loss={torch.cat(losses).mean().item():.6f}")


if __name__ == "__main__":
    main()
