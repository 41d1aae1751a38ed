"""A tiny GPT-2 built from a `transformers` config, trained in a plain loop (random weights, nothing downloaded).

The data's token ids come from GPT-2's BPE vocabulary of 50257 tokens; the model's embedding and its tied LM
head are sized by the config's `vocab_size`, written separately, as a script that builds its config by hand
does. The LM head (8 x 64 tokens x 64 x 50257) is most of the step's work: the classic padding target
(nanoGPT pads it to 50304).

    tpu-agent tune examples/hf_gpt2.py --trials 8
    tpu-agent tune examples/hf_gpt2.py --trials 8 --allow model   # also the vocabulary rows
"""

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel

TOKENIZER_VOCAB = 50257  # the data: GPT-2's BPE token ids
BATCH = 8
SEQ_LEN = 64

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--device", default="tpu")
args = parser.parse_args()

torch.manual_seed(0)
config = GPT2Config(vocab_size=50257, n_positions=SEQ_LEN, n_embd=64, n_layer=2, n_head=4)
model = GPT2LMHeadModel(config).to(args.device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

generator = torch.Generator().manual_seed(1)
batches = [torch.randint(0, TOKENIZER_VOCAB, (BATCH, SEQ_LEN), generator=generator) for _ in range(4)]

for step in range(args.steps):
    ids = batches[step % len(batches)].to(args.device)
    loss = model(input_ids=ids, labels=ids).loss  # next-token loss: the labels are the inputs, shifted inside
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if step % 10 == 0:
        print(f"step {step}: loss {loss.item():.4f}")
