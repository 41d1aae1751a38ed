"""Tracing a real (tiny) training script on meta and lowering it: the program computes the script's own step."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tpu_agent.projection import attention, lower, record

TINY = Path(__file__).with_name("tiny_llama.py")


@pytest.mark.parametrize("causal", [True, False])
def test_attention_lowering_matches_pytorch_forward_and_backward(causal):
    import jax
    import jax.numpy as jnp

    torch.manual_seed(0)
    q = torch.randn(2, 4, 40, 16, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 40, 16, dtype=torch.float64, requires_grad=True)  # grouped-query: 2 kv heads
    v = torch.randn(2, 2, 40, 16, dtype=torch.float64, requires_grad=True)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    grad = torch.randn_like(out)
    out.backward(grad)
    old = attention.CHUNK, attention.CAUSAL_BLOCK
    attention.CHUNK = attention.CAUSAL_BLOCK = 16  # three chunks, the last one short
    try:
        lower._tables()  # 64-bit types on, as the device runs them
        jq, jk, jv, jg = (jnp.asarray(t.detach().numpy()) for t in (q, k, v, grad))
        o, lse = attention.lower_forward(jq, jk, jv, None, causal, 0.25)
        dq, dk, dv = attention.lower_backward(jg, jq, jk, jv, None, o, lse, causal, 0.25)
        # a causal block reads only the keys up to its last row (those above the diagonal are skipped)
        assert attention._blocks(40, 40, causal) == ([(0, 16), (16, 32), (32, 40)] if causal else
                                                     [(0, 40), (16, 40), (32, 40)])
    finally:
        attention.CHUNK, attention.CAUSAL_BLOCK = old
    np.testing.assert_allclose(np.asarray(o), out.detach().numpy(), rtol=1e-5, atol=1e-6)  # scores in float32, as on a TPU
    for mine, theirs in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        np.testing.assert_allclose(np.asarray(mine), theirs.numpy(), rtol=1e-5, atol=1e-5)


def test_the_recorded_step_is_the_scripts_step(monkeypatch):
    """Record step 2 of the tiny script on meta (every block), run the lowered program on the values a CPU run
    had before its step 2, and compare with the parameters PyTorch's own step 2 gives. SGD with momentum: AdamW
    reads its step count on the host, which a meta run cannot (it reads 1.0; the costs do not depend on it)."""
    import jax

    rec = record.record(str(TINY), ["--steps", "3", "--optimizer", "sgd"], scale_layers=False, lowerable=lower.lowerable)
    assert rec.blocks_total is None and len(rec.graphs) == 1
    graph = rec.graphs[0]
    roles = {role for *_, role, _name in graph.inputs.values()}
    assert {"param", "state", "data"} <= roles
    assert any(n.func is torch.ops.tpu_project.attention.default for n in graph.nodes)
    assert any(n.backward for n in graph.nodes) and not graph.nodes[0].backward

    # the same step on the CPU, from a seeded model after one step
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    batches = [torch.randint(0, 256, (8, 32)) for _ in range(2)]
    for ids in batches[:1]:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    names = dict(model.named_parameters())
    values = {name: p.detach().clone() for name, p in names.items()}
    for p, state in opt.state.items():
        name = next(n for n, q in names.items() if q is p)
        for key, value in state.items():
            values[f"state:{key}:{name}"] = value.detach().clone()
    for name, b in model.named_buffers():
        values[f"buffer:{name}"] = b.detach().clone()
    ids = batches[1]
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()

    fn = lower.Lowered(graph)
    arrays = []
    for vid in fn.input_ids:
        shape, dtype, role, name = graph.inputs[vid]
        if role == "data" and tuple(shape) == (8, 32):
            arrays.append(ids.numpy())  # the batch the script drew
        elif role == "data":
            assert 0 in shape  # empty placeholders PyTorch keeps between steps
            arrays.append(np.zeros(shape, np.float32))
        else:
            arrays.append(values[name].numpy())
    outputs = jax.jit(fn)(*arrays)
    # the outputs are new values of written inputs: map them back through the recorder's bookkeeping
    written = {}
    for node in graph.nodes:
        for _arg, old, new in node.written:
            written[new] = written.get(old, old)
    by_name = {graph.inputs[written[v]][3]: np.asarray(o) for v, o in zip(fn.output_ids, outputs) if v in written}
    checked = 0
    for name, p in names.items():
        if name in by_name:
            np.testing.assert_allclose(by_name[name], p.detach().numpy(), rtol=2e-4, atol=2e-5, err_msg=name)
            checked += 1
    assert checked == len(names)


def test_a_transposed_activation_keeps_its_batch_split():
    """A weight gradient is grad_out.t() @ input: its left operand carries the batch (x sequence) in its last dim.
    Left unconstrained there, XLA:CPU's partitioner gathered it whole on Llama 3.1 8B at 256 chips (a 32 GiB
    all-gather per k/v projection) instead of reduce-scattering the gradient: the batch dim a transpose or permute
    moves must be followed and constrained where it went."""
    import jax

    from tpu_agent.projection.partition import _dtype

    rec = record.record(str(TINY), ["--steps", "3", "--optimizer", "sgd", "--batch", "16"], scale_layers=True,
                        lowerable=lower.lowerable)
    graph = rec.graphs[-1]
    calls = []

    def rule(shape, backward=False, dim=0):
        calls.append((tuple(shape), backward, dim))
        return None

    fn = lower.Lowered(graph, rule)
    avals = [jax.ShapeDtypeStruct(graph.inputs[v][0], _dtype(graph.inputs[v][1])) for v in fn.input_ids]
    jax.eval_shape(fn, *avals)
    tokens = 16 * 32  # batch x sequence
    transposed = [c for c in calls if c[1] and type(c[2]) is int and c[2] == len(c[0]) - 1 and c[0][-1] == tokens]
    assert transposed, "no backward value with the batch x sequence in its last dim was constrained there"
    assert all(type(c[2]) is int or c[2] is None for c in calls)
