"""A small Qwen3-MoE causal LM from a config, its experts run as transformers' "eager" loop (the experts a
batch hits, one at a time, each with its own token count): the MoE shape of a user's script.

    python moe_loop.py --device cpu --steps 20
    tpu-agent tune moe_loop.py --trials 4 -- --steps 60
"""

from __future__ import annotations

import argparse

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

parser = argparse.ArgumentParser()
parser.add_argument("--device", default="tpu")
parser.add_argument("--steps", type=int, default=40)
args = parser.parse_args()

torch.manual_seed(0)
config = Qwen3MoeConfig(experts_implementation="eager", vocab_size=256, hidden_size=64, intermediate_size=128,
                        moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                        decoder_sparse_step=1)
model = Qwen3MoeForCausalLM(config).to(args.device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
tokens = torch.randint(0, config.vocab_size, (64, 33), generator=torch.Generator().manual_seed(1))

for step in range(args.steps):
    batch = tokens[(step * 8) % 64:(step * 8) % 64 + 8].to(args.device)
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if step % 10 == 0:
        print(f"step {step}: loss {loss.item():.4f}")
