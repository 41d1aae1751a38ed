"""A tiny Llama training script for the projection tests (3 decoder layers, AdamW or SGD, a batch drawn on the device)."""

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=5)
p.add_argument("--batch", type=int, default=8)
p.add_argument("--hidden", type=int, default=64)
p.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"])
a = p.parse_args()
cfg = LlamaConfig(vocab_size=256, hidden_size=a.hidden, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
model = LlamaForCausalLM(cfg).to("tpu")
if a.optimizer == "sgd":  # reads no value on the host (AdamW's step count is read by .item())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
else:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(a.steps):
    x = torch.randint(0, 256, (a.batch, 32), device="tpu")
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    print(step, float(loss.item()))
