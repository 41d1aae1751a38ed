"""Train a tiny GPT (2 blocks, d_model 128, GPT-2 vocabulary) on random tokens.

Attention is written out by hand (matmul, causal mask, softmax), the way many
research scripts do it, rather than with `scaled_dot_product_attention`.

    python examples/transformer.py --device cpu --steps 20
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from training import arguments, train

VOCAB = 50257  # GPT-2's vocabulary: not a multiple of 128
SEQ_LEN = 64
BATCH = 8
D_MODEL = 128
N_HEADS = 4
N_LAYERS = 2
D_MLP = 512
NUM_BATCHES = 4


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL)
        self.proj = nn.Linear(D_MODEL, D_MODEL)
        mask = torch.triu(torch.ones(SEQ_LEN, SEQ_LEN, dtype=torch.bool), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x):
        b, t, c = x.shape
        head_dim = c // N_HEADS
        q, k, v = self.qkv(x).split(c, dim=-1)
        q = q.view(b, t, N_HEADS, head_dim).transpose(1, 2)  # (b, heads, t, head_dim)
        k = k.view(b, t, N_HEADS, head_dim).transpose(1, 2)
        v = v.view(b, t, N_HEADS, head_dim).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(head_dim)
        scores = scores.masked_fill(self.mask[:t, :t], float("-inf"))
        weights = F.softmax(scores, dim=-1)
        out = torch.matmul(weights, v).transpose(1, 2).reshape(b, t, c)
        return self.proj(out)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(D_MODEL)
        self.attn = CausalSelfAttention()
        self.ln2 = nn.LayerNorm(D_MODEL)
        self.mlp = nn.Sequential(nn.Linear(D_MODEL, D_MLP), nn.GELU(), nn.Linear(D_MLP, D_MODEL))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, D_MODEL)
        self.pos_emb = nn.Embedding(SEQ_LEN, D_MODEL)
        self.blocks = nn.ModuleList(Block() for _ in range(N_LAYERS))
        self.ln_f = nn.LayerNorm(D_MODEL)
        self.lm_head = nn.Linear(D_MODEL, VOCAB, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # tied, as in GPT-2
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx):
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def main():
    args = arguments(__doc__, lr=1e-3).parse_args()

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    generator = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, VOCAB, (NUM_BATCHES, BATCH, SEQ_LEN + 1), generator=generator)
    tokens = tokens.to(device)

    model = TinyGPT().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)

    def batch_of(step):
        batch = tokens[step % NUM_BATCHES]
        return batch[:, :-1], batch[:, 1:]  # predict the next token

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))

    train(model, optimizer, loss_fn, batch_of, args)


if __name__ == "__main__":
    main()
