"""Train a small causal LM on sentences of different lengths, each batch padded to its own longest.

The common way to batch text (`pad_sequence` in a collate function, as
`DataCollatorWithPadding` and `padding="longest"` do): the padded positions get
the pad id in the inputs and -100 in the labels, so the loss leaves them out.
On an XLA device every new batch length is a new program to compile.

    python examples/varlen_lm.py --device cpu --steps 30
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset

VOCAB = 512
PAD_ID = 0
D_MODEL = 64
N_HEADS = 4
N_LAYERS = 2
MAX_LEN = 96
BATCH = 8


class Sentences(Dataset):
    """Token sequences of 8 to MAX_LEN tokens: a next-token task with a learnable rule."""

    def __init__(self, count: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for _ in range(count):
            n = int(torch.randint(8, MAX_LEN + 1, (1,), generator=g))
            start = torch.randint(1, VOCAB, (1,), generator=g)
            self.items.append((start + torch.arange(n) * 7) % (VOCAB - 1) + 1)  # ids 1..VOCAB-1; 0 pads

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def collate(batch):
    """Pad to the batch's longest sentence: inputs with PAD_ID, labels with -100."""
    ids = pad_sequence(batch, batch_first=True, padding_value=PAD_ID)
    labels = pad_sequence(batch, batch_first=True, padding_value=-100)
    return {"input_ids": ids[:, :-1], "labels": labels[:, 1:]}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(D_MODEL)
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL)
        self.proj = nn.Linear(D_MODEL, D_MODEL)
        self.ln2 = nn.LayerNorm(D_MODEL)
        self.mlp = nn.Sequential(nn.Linear(D_MODEL, 4 * D_MODEL), nn.GELU(), nn.Linear(4 * D_MODEL, D_MODEL))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=-1)
        q, k, v = (z.view(b, t, N_HEADS, c // N_HEADS).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # padding sits at the end: never attended
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D_MODEL)
        self.pos = nn.Embedding(MAX_LEN, D_MODEL)
        self.blocks = nn.ModuleList(Block() for _ in range(N_LAYERS))
        self.ln_f = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)

    def forward(self, input_ids):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.tok(input_ids) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="tpu")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    torch.manual_seed(0)
    device = torch.device(args.device)
    loader = DataLoader(Sentences(BATCH * args.steps), batch_size=BATCH, shuffle=True, collate_fn=collate,
                        generator=torch.Generator().manual_seed(0))
    model = TinyLM().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step, batch in enumerate(loader, start=1):
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = model(batch["input_ids"])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch["labels"].reshape(-1), ignore_index=-100)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 10 == 0 or step == 1:
            print(f"step {step} length {batch['input_ids'].shape[1]} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
