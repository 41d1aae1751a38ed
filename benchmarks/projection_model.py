"""A decoder-only training script at real size for `tpu-agent project` (the validation rows of projection_table.py).

Hugging Face configs built here from published values (nothing downloaded); the model is built on the `tpu`
device, which `tpu-agent project` reads as meta: no memory. Llama-style dense models, or Mixtral-style MoE
(its experts run as MaxText's dropping implementation does: a dense GShard-style dispatch, every expert seeing
capacity = ceil(sequence x top_k / experts) x capacity factor tokens of each sequence).
"""

from __future__ import annotations

import argparse
import math

import torch
from torch import nn


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, required=True)
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--heads", type=int, required=True)
    p.add_argument("--kv-heads", type=int)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--mlp", type=int, required=True)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, required=True, help="global batch (sequences)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--experts", type=int, default=0)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--moe-mlp", type=int, help="each expert's intermediate size (default: --mlp)")
    p.add_argument("--moe", choices=("dropping", "sorted", "gathered"), default="dropping",
                   help="dropping: MaxText's dense-dispatch MoE with a capacity factor; sorted: MaxText's sparse_matmul "
                        "(tokens sorted by expert, each expert's rows one matmul) with routing balanced, as the Ironwood "
                        "recipes run it (use_random_routing: every expert gets seq x top_k / experts rows of a sequence); "
                        "gathered: sorted with the sort's gathers traced (an experiment: docs/benchmarks.md)")
    p.add_argument("--capacity-factor", type=float, default=1.0,
                   help="MaxText's capacity_factor: each expert takes ceil(seq x top_k / experts) x this tokens of a "
                        "sequence (MaxText's generate_masks)")
    p.add_argument("--remat", choices=("none", "full", "qkv", "mlp", "minimal", "attn"), default="none", nargs="?",
                   const="full",
                   help="activation checkpointing as MaxText's remat_policy: full (every decoder layer; --remat alone), "
                        "qkv (custom: the layer input and q/k/v projections kept, the rest recomputed), minimal (the "
                        "projections kept, attention recomputed), mlp (custom with out_proj kept too: only the "
                        "MLP block recomputed), attn (custom keeping the layer input, q/k/v and the attention output "
                        "(context): o_proj and the MLP recomputed, as the Ironwood Llama 3.1 70B recipe), none")
    p.add_argument("--steps", type=int, default=4)
    return p.parse_args()


class DenseMoE(nn.Module):
    """Top-k routing with a fixed capacity per expert, computed densely (einsum dispatch), as MaxText's dropping
    MoE does: shapes never depend on the data."""

    def __init__(self, hidden, mlp, experts, top_k, capacity_factor=1.0):
        super().__init__()
        self.router = nn.Linear(hidden, experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(experts, hidden, mlp))
        self.w3 = nn.Parameter(torch.empty(experts, hidden, mlp))
        self.w2 = nn.Parameter(torch.empty(experts, mlp, hidden))
        self.experts, self.top_k, self.capacity_factor = experts, top_k, capacity_factor

    def forward(self, x):
        b, s, h = x.shape
        # per sequence (one routing group per sequence), as MaxText's generate_masks
        capacity = int(max(math.ceil(s * self.top_k / self.experts) * self.capacity_factor, self.capacity_factor))
        probs = self.router(x).softmax(-1)
        weights, _ = probs.topk(self.top_k, dim=-1)
        # dispatch: [batch, experts, capacity, seq], one-hot in a real router; its values do not matter here
        dispatch = (probs.transpose(1, 2)[:, :, None, :] * 0).expand(b, self.experts, capacity, s).to(x.dtype)
        inputs = torch.einsum("becs,bsh->bech", dispatch, x)
        act = nn.functional.silu(torch.einsum("bech,ehm->becm", inputs, self.w1)) \
            * torch.einsum("bech,ehm->becm", inputs, self.w3)
        out = torch.einsum("becm,emh->bech", act, self.w2)
        return torch.einsum("becs,bech->bsh", dispatch, out) * weights.sum(-1, keepdim=True)


class SortedMoE(nn.Module):
    """Top-k routing computed as MaxText's sparse_matmul runs it when routing is balanced (use_random_routing, which
    the Ironwood MoE recipes set): each (token, choice) row of a sequence goes to one expert, every expert gets
    seq x top_k / experts rows of each sequence and runs them as one matmul; the FLOPs are the active experts'
    only. Shapes must not depend on the data, and a data-dependent sort (gather/scatter by index) is partitioned
    by XLA:CPU's SPMD partitioner as a replicated batch (all-reduces of the whole global batch), so the rows are
    laid out by position instead: the same shapes, FLOPs and bytes moved as a balanced sort-and-gather, without the
    sort's own cost (an argsort of seq x top_k ids per sequence)."""

    def __init__(self, hidden, mlp, experts, top_k):
        super().__init__()
        self.router = nn.Linear(hidden, experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(experts, hidden, mlp))
        self.w3 = nn.Parameter(torch.empty(experts, hidden, mlp))
        self.w2 = nn.Parameter(torch.empty(experts, mlp, hidden))
        self.experts, self.top_k = experts, top_k

    def route(self, x):
        """The router's top-k weights and choices [b, s, k], and the (token, choice) rows per sequence."""
        rows = x.shape[1] * self.top_k
        if rows % self.experts:
            raise SystemExit(f"sorted MoE: seq x top_k = {rows} does not divide by {self.experts} experts")
        weights, chosen = self.router(x).softmax(-1).topk(self.top_k, dim=-1)
        return weights, chosen, rows

    def expert_mlp(self, xs):
        """Each expert's SwiGLU MLP over its group of rows, xs [b, experts, rows per expert, h]."""
        act = nn.functional.silu(torch.einsum("bech,ehm->becm", xs, self.w1)) * torch.einsum("bech,ehm->becm", xs, self.w3)
        return torch.einsum("becm,emh->bech", act, self.w2)

    def forward(self, x):
        b, s, h = x.shape
        weights, _chosen, rows = self.route(x)
        xs = x[:, :, None, :].expand(b, s, self.top_k, h).reshape(b, self.experts, rows // self.experts, h)
        out = self.expert_mlp(xs).reshape(b, s, self.top_k, h)
        return (out * weights[..., None].to(out.dtype)).sum(2)


class _Rows(torch.autograd.Function):
    """The rows of x [b, n, h] taken in the order `index` [b, m] (a gather per sequence); backward takes the
    gradient's rows back by `inverse` [b, m] and sums the m / n copies of each row, as MaxText's _sort_activations
    (a custom VJP: a gather both ways, no scatter). A gather with a batch dim is split by the batch when partitioned."""

    @staticmethod
    def forward(ctx, x, index, inverse):
        ctx.save_for_backward(inverse)
        ctx.n = x.shape[1]
        return torch.gather(x, 1, index[..., None].expand(*index.shape, x.shape[-1]))

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        back = torch.gather(grad, 1, inverse[..., None].expand(*inverse.shape, grad.shape[-1]))
        b, m, h = back.shape
        return back.reshape(b, ctx.n, m // ctx.n, h).sum(2), None, None


class GatheredMoE(SortedMoE):
    """SortedMoE with the sort itself: each sequence's (token, choice) rows sorted by expert (an argsort and a
    gather), run as SortedMoE's balanced groups, then gathered back into token order (MaxText's sparse_matmul
    permute and unpermute, _sort_activations both ways). Traced, the gathers stay split by the batch (no
    collectives), but XLA:CPU runs torch's gather element-wise, in f32, with a coordinate triple per element: their
    traffic reads about 3.5x the rows' bytes (docs/benchmarks.md), so the table's rows keep SortedMoE."""

    def forward(self, x):
        b, s, h = x.shape
        weights, chosen, rows = self.route(x)
        order = chosen.reshape(b, rows).argsort(-1)  # each sequence's (token, choice) rows by expert
        inverse = order.argsort(-1)
        xs = _Rows.apply(x, order // self.top_k, inverse).reshape(b, self.experts, rows // self.experts, h)
        out = self.expert_mlp(xs).reshape(b, rows, h)
        out = _Rows.apply(out, inverse, order).reshape(b, s, self.top_k, h)  # back in token order
        return (out * weights[..., None].to(out.dtype)).sum(2)


def _rms(x, weight, eps):
    f = x.float()
    return weight * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class NormQKV(torch.autograd.Function):
    """RMSNorm then the q/k/v projections, saving only the layer input: backward recomputes the norm (not the
    projections) for the weight and input gradients, as a JAX remat policy that saves q/k/v and the layer input
    does (MaxText's custom policy)."""

    @staticmethod
    def forward(ctx, x, norm_w, wq, wk, wv, eps):
        h = _rms(x, norm_w, eps)
        ctx.save_for_backward(x, norm_w, wq, wk, wv)
        ctx.eps = eps
        return h @ wq.t(), h @ wk.t(), h @ wv.t()

    @staticmethod
    def backward(ctx, dq, dk, dv):
        x, norm_w, wq, wk, wv = ctx.saved_tensors
        with torch.enable_grad():
            x_, w_ = x.detach().requires_grad_(), norm_w.detach().requires_grad_()
            h = _rms(x_, w_, ctx.eps)
            dh = dq @ wq + dk @ wk + dv @ wv
            dx, dnorm = torch.autograd.grad(h, (x_, w_), dh)
        flat = h.detach().reshape(-1, h.shape[-1])
        grads = [d.reshape(-1, d.shape[-1]).t() @ flat for d in (dq, dk, dv)]
        return dx, dnorm, *grads, None


def _checkpointed(layer, policy: str):
    """A decoder layer's forward with part of it recomputed in backward, as MaxText's remat policies do.

    qkv: MaxText's `custom` policy with decoder_layer_input, query_proj, key_proj, value_proj (and out_proj)
    offloaded or kept: everything after the q/k/v projections (attention, o_proj, the MLP) is recomputed; the
    normed input stays saved here as the projections' input (MaxText recomputes that norm).
    mlp: `custom` with out_proj kept as well (MaxText's Mixtral v6e recipe): attention and o_proj run once, the
    MLP block (post-attention norm and MLP, or the MoE) is recomputed.
    minimal: `checkpoint_dots_with_no_batch_dims`: every projection's output kept, the attention core (a dot with
    batch dims, the splash kernel) recomputed."""
    from torch.utils.checkpoint import checkpoint
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    attn = layer.self_attn

    def core(q, k, v, cos, sin):
        shape = (*q.shape[:-1], -1, attn.head_dim)
        q, k, v = (x.view(shape).transpose(1, 2) for x in (q, k, v))
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scaling, enable_gqa=True)
        return out.transpose(1, 2).reshape(*out.shape[:1], out.shape[2], -1)

    def rest(residual, q, k, v, cos, sin):
        x = residual + attn.o_proj(core(q, k, v, cos, sin))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def forward(hidden_states, *args, position_embeddings=None, **kwargs):
        cos, sin = position_embeddings
        if policy != "attn":
            h = layer.input_layernorm(hidden_states)
            q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
        if policy == "qkv":
            return checkpoint(rest, hidden_states, q, k, v, cos, sin, use_reentrant=False)
        if policy == "attn":  # the layer input, q/k/v and the context kept; the norm, o_proj and the MLP recomputed
            q, k, v = NormQKV.apply(hidden_states, layer.input_layernorm.weight, attn.q_proj.weight,
                                    attn.k_proj.weight, attn.v_proj.weight, layer.input_layernorm.variance_epsilon)
            shape = (*q.shape[:-1], -1, attn.head_dim)
            q, k, v = (x.view(shape).transpose(1, 2) for x in (q, k, v))
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scaling,
                                                             enable_gqa=True)

            def after(residual, out):  # from the attention's own output (saved by it): no second copy kept
                x = residual + attn.o_proj(out.transpose(1, 2).reshape(*out.shape[:1], out.shape[2], -1))
                return x + layer.mlp(layer.post_attention_layernorm(x))

            return checkpoint(after, hidden_states, out, use_reentrant=False)
        if policy == "mlp":
            x = hidden_states + attn.o_proj(core(q, k, v, cos, sin))
            return checkpoint(lambda x: x + layer.mlp(layer.post_attention_layernorm(x)), x, use_reentrant=False)
        x = hidden_states + attn.o_proj(checkpoint(core, q, k, v, cos, sin, use_reentrant=False))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    return forward


def build(a):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.mlp, num_hidden_layers=a.layers,
                      num_attention_heads=a.heads, num_key_value_heads=a.kv_heads or a.heads, head_dim=a.head_dim,
                      max_position_embeddings=a.seq, tie_word_embeddings=False, attn_implementation="sdpa")
    with torch.device("tpu"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
        if a.experts:
            for layer in model.model.layers:
                mlp = a.moe_mlp or a.mlp
                kind = {"sorted": SortedMoE, "gathered": GatheredMoE}.get(a.moe)
                layer.mlp = (kind(a.hidden, mlp, a.experts, a.top_k) if kind else
                             DenseMoE(a.hidden, mlp, a.experts, a.top_k, a.capacity_factor)).to(torch.bfloat16)
    if a.remat == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif a.remat in ("qkv", "mlp", "minimal", "attn"):
        for layer in model.model.layers:
            layer.forward = _checkpointed(layer, a.remat)
    return model


def main():
    a = parse()
    model = build(a)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(a.steps):
        ids = torch.randint(0, a.vocab, (a.batch, a.seq), device="tpu")
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()


if __name__ == "__main__":
    main()
