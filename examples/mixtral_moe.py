"""Train a small mixture-of-experts LM whose MoE block loops over its experts, as Mixtral's code does.

The block is the one people copy from Mixtral (`MixtralSparseMoeBlock`): a
router picks each token's top 2 of 8 experts, and a loop over the experts
gathers each expert's tokens with `torch.where`, runs the expert on them and
adds the result back with `index_add_`. How many tokens an expert gets
changes every step, so on an XLA device every count is a new program to
compile, and `torch.where` must read the routing on the host first.

    python examples/mixtral_moe.py --device cpu --steps 20
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 256
D_MODEL = 64
D_FF = 128
N_EXPERTS = 8
TOP_K = 2
SEQ_LEN = 32
BATCH = 8


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(D_MODEL, D_FF, bias=False)
        self.w2 = nn.Linear(D_FF, D_MODEL, bias=False)
        self.w3 = nn.Linear(D_MODEL, D_FF, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class SparseMoeBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_experts = N_EXPERTS
        self.top_k = TOP_K
        self.gate = nn.Linear(D_MODEL, N_EXPERTS, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(N_EXPERTS))

    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        final_hidden_states = torch.zeros((batch_size * sequence_length, hidden_dim), dtype=hidden_states.dtype,
                                          device=hidden_states.device)
        expert_mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        for expert_idx in range(self.num_experts):
            expert_layer = self.experts[expert_idx]
            idx, top_x = torch.where(expert_mask[expert_idx])  # how many tokens: known only from the data
            current_state = hidden_states[None, top_x].reshape(-1, hidden_dim)
            current_hidden_states = expert_layer(current_state) * routing_weights[top_x, idx, None]
            final_hidden_states.index_add_(0, top_x, current_hidden_states.to(hidden_states.dtype))
        final_hidden_states = final_hidden_states.reshape(batch_size, sequence_length, hidden_dim)
        return final_hidden_states, router_logits


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(D_MODEL)
        self.attn = nn.MultiheadAttention(D_MODEL, 4, batch_first=True)
        self.ln2 = nn.LayerNorm(D_MODEL)
        self.moe = SparseMoeBlock()
        mask = torch.triu(torch.ones(SEQ_LEN, SEQ_LEN, dtype=torch.bool), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=self.mask, need_weights=False)[0]
        out, _router_logits = self.moe(self.ln2(x))
        return x + out


class MoeLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D_MODEL)
        self.pos = nn.Embedding(SEQ_LEN, D_MODEL)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.ln_f = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)

    def forward(self, ids):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def batch_of(step: int, device) -> torch.Tensor:
    """Sequences that count up by a per-sequence stride: a next-token rule the model can learn."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
    stride = torch.randint(1, 8, (BATCH, 1), generator=g)
    return ((start + stride * torch.arange(SEQ_LEN + 1)) % VOCAB).to(device)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="tpu")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    torch.manual_seed(0)
    device = torch.device(args.device)
    model = MoeLM().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(1, args.steps + 1):
        seq = batch_of(step, device)
        logits = model(seq[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), seq[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 10 == 0 or step == 1:
            print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
