"""nn.LSTM, nn.GRU and nn.RNN (tanh, relu) on tpu against PyTorch on the CPU: outputs, final states and the
gradients of the input, the initial states and every parameter within 1e-5, in sequence form (multi-layer,
bidirectional, batch_first, proj_size, no biases, packed sequences) and cell form. A sequence is one op each
way whatever its length (eager, fused and compiled modes); dropout between layers draws its masks from the
device's RNG (rate, scaling, the backward's same mask, reproducible under a seed, off in eval)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from tpu_agent.backend.core import executables
from tpu_agent.backend.ops import recurrent  # noqa: F401  (defines the tpu_agent:: ops, as the first op does)
from support.dispatched import Ops

RNN = torch.ops.tpu_agent.rnn.default
RNN_BACKWARD = torch.ops.tpu_agent.rnn_backward.default
T, B, IN, HID = 5, 3, 4, 6


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _module(cls, seed=0, **kwargs):
    torch.manual_seed(seed)
    return cls(IN, HID, **kwargs)


def _states(module, batch, seed=1):
    g = torch.Generator().manual_seed(seed)
    dirs = 2 if module.bidirectional else 1
    out_size = module.proj_size if getattr(module, "proj_size", 0) else module.hidden_size
    h0 = torch.randn(module.num_layers * dirs, batch, out_size, generator=g)
    if isinstance(module, nn.LSTM):
        return (h0, torch.randn(module.num_layers * dirs, batch, module.hidden_size, generator=g))
    return h0


def _run(module, device, x, state, lengths=None):
    """Outputs and gradients (input, initial states, parameters) of one forward and backward, on the CPU."""
    m = module.to(device)
    leaves = [x.to(device).detach().requires_grad_()]
    if state is not None:
        leaves += [s.to(device).detach().requires_grad_() for s in (state if isinstance(state, tuple) else (state,))]
    xin = leaves[0]
    if lengths is not None:
        xin = pack_padded_sequence(xin, lengths, batch_first=m.batch_first, enforce_sorted=False)
    hidden = None if state is None else (tuple(leaves[1:]) if len(leaves) > 2 else leaves[1])
    with Ops() as ops:
        out, final = m(xin, hidden)
        if lengths is not None:
            out, _ = pad_packed_sequence(out, batch_first=m.batch_first)
        finals = final if isinstance(final, tuple) else (final,)
        loss = (out * out).sum() + sum((f * f * 0.5).sum() for f in finals)
        loss.backward()
    grads = [t.grad for t in leaves] + [p.grad for p in m.parameters()]
    results = [t.detach().cpu() for t in (out, *finals, *grads)]
    m.zero_grad(set_to_none=True)
    module.to("cpu")
    return results, ops.seen


SEQUENCES = {
    "lstm": (nn.LSTM, {}),
    "lstm 2 layers bidirectional batch_first": (nn.LSTM, {"num_layers": 2, "bidirectional": True, "batch_first": True}),
    "lstm proj_size": (nn.LSTM, {"num_layers": 2, "proj_size": 3}),
    "lstm proj_size bidirectional no bias": (nn.LSTM, {"proj_size": 2, "bidirectional": True, "bias": False}),
    "gru 2 layers bidirectional": (nn.GRU, {"num_layers": 2, "bidirectional": True}),
    "gru batch_first no bias": (nn.GRU, {"batch_first": True, "bias": False}),
    "rnn tanh 2 layers": (nn.RNN, {"num_layers": 2}),
    "rnn relu bidirectional batch_first": (nn.RNN, {"nonlinearity": "relu", "bidirectional": True,
                                                     "batch_first": True}),
}


def _input(batch_first, seed=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*((B, T) if batch_first else (T, B)), IN, generator=g)


@pytest.mark.parametrize("case", SEQUENCES)
@pytest.mark.parametrize("given_state", [True, False], ids=["h0", "no-h0"])
def test_a_sequence_matches_the_cpu_forward_and_backward_as_one_op_each_way(case, given_state):
    cls, kwargs = SEQUENCES[case]
    module = _module(cls, **kwargs)
    x = _input(module.batch_first)
    state = _states(module, B) if given_state else None
    expected, _ = _run(module, "cpu", x, state)
    got, seen = _run(module, "tpu", x, state)
    assert seen.count(RNN) == 1 and seen.count(RNN_BACKWARD) == 1
    assert not {torch.ops.aten._thnn_fused_lstm_cell.default, torch.ops.aten._thnn_fused_gru_cell.default,
                torch.ops.aten.mm.default, torch.ops.aten.addmm.default} & set(seen)
    assert len(got) == len(expected)
    for i, (a, b) in enumerate(zip(got, expected)):
        assert a.shape == b.shape, (case, i)
        assert _rel(a, b) < 1e-5, (case, i, _rel(a, b))


@pytest.mark.parametrize("cls,kwargs", [(nn.LSTM, {"num_layers": 2, "bidirectional": True}),
                                        (nn.GRU, {"batch_first": True}),
                                        (nn.RNN, {"nonlinearity": "relu", "bidirectional": True})],
                         ids=["lstm", "gru", "rnn-relu"])
def test_packed_sequences_of_unsorted_lengths_match_the_cpu(cls, kwargs):
    module = _module(cls, **kwargs)
    x = _input(module.batch_first)
    lengths = torch.tensor([3, 5, 1])  # unsorted: pack_padded_sequence sorts, the module permutes h0
    expected, _ = _run(module, "cpu", x, _states(module, B), lengths)
    got, seen = _run(module, "tpu", x, _states(module, B), lengths)
    assert seen.count(RNN) == 1 and seen.count(RNN_BACKWARD) == 1
    for i, (a, b) in enumerate(zip(got, expected)):
        assert a.shape == b.shape and _rel(a, b) < 1e-5, (i, _rel(a, b))


CELLS = {
    "lstm cell": (nn.LSTMCell, {}, torch.ops.aten._thnn_fused_lstm_cell.default),
    "lstm cell no bias": (nn.LSTMCell, {"bias": False}, torch.ops.aten._thnn_fused_lstm_cell.default),
    "gru cell": (nn.GRUCell, {}, torch.ops.aten._thnn_fused_gru_cell.default),
    "gru cell no bias": (nn.GRUCell, {"bias": False}, torch.ops.aten._thnn_fused_gru_cell.default),
    "rnn cell tanh": (nn.RNNCell, {}, None),
    "rnn cell relu": (nn.RNNCell, {"nonlinearity": "relu"}, None),
}


def _run_cell(module, device, x, h0):
    m = module.to(device)
    x = x.to(device).detach().requires_grad_()
    h0 = tuple(h.to(device).detach().requires_grad_() for h in h0)
    with Ops() as ops:
        state = h0 if len(h0) > 1 else h0[0]
        outs = []
        for t in range(x.shape[0]):  # a loop over steps, as a user writes it
            state = m(x[t], state)
            outs.append(state[0] if isinstance(state, tuple) else state)
        loss = sum((o * o).sum() for o in outs)
        if isinstance(state, tuple):
            loss = loss + (state[1] * state[1]).sum()
        loss.backward()
    grads = [x.grad, *(h.grad for h in h0), *(p.grad for p in m.parameters())]
    results = [t.detach().cpu() for t in (*outs, *grads)]
    module.to("cpu").zero_grad(set_to_none=True)
    return results, ops.seen


@pytest.mark.parametrize("case", CELLS)
def test_a_cell_stepped_in_a_loop_matches_the_cpu(case):
    cls, kwargs, fused = CELLS[case]
    module = _module(cls, **kwargs)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(T, B, IN, generator=g)
    h0 = tuple(torch.randn(B, HID, generator=g) for _ in range(2 if cls is nn.LSTMCell else 1))
    expected, _ = _run_cell(module, "cpu", x, h0)
    got, seen = _run_cell(module, "tpu", x, h0)
    if fused is not None:
        assert seen.count(fused) == T
    for i, (a, b) in enumerate(zip(got, expected)):
        assert a.shape == b.shape and _rel(a, b) < 1e-5, (case, i, _rel(a, b))


def test_an_unbatched_input_and_the_half_precision_types_run():
    module = _module(nn.LSTM, num_layers=2)
    x = _input(False)[:, 0]
    with torch.no_grad():
        out_cpu, (h_cpu, _) = module(x)
        out, (h, _) = module.to("tpu")(x.to("tpu"))
        assert out.shape == out_cpu.shape and _rel(out.cpu(), out_cpu) < 1e-5 and _rel(h.cpu(), h_cpu) < 1e-5
        out_bf, _ = module.to(torch.bfloat16)(x.to("tpu", torch.bfloat16))
    assert out_bf.dtype == torch.bfloat16 and _rel(out_bf.float().cpu(), out_cpu) < 3e-2


def _identity_stack(p, layers=2, width=64):
    """An RNN whose layers pass positive inputs through (identity input weights, no recurrence, relu): its
    output is the input with dropout applied between layers, so the masks can be read off."""
    module = nn.RNN(width, width, num_layers=layers, nonlinearity="relu", bias=False, dropout=p)
    with torch.no_grad():
        for name, w in module.named_parameters():
            w.copy_(torch.eye(width) if "ih" in name else torch.zeros_like(w))
    return module


def test_dropout_between_layers_draws_masks_from_the_device_rng():
    p = 0.3
    module = _identity_stack(p).to("tpu")
    x_cpu = torch.rand(8, 16, 64) + 0.5  # positive: relu passes it through
    x = x_cpu.to("tpu").requires_grad_()
    torch.manual_seed(5)
    out, _ = module(x)
    out.sum().backward()
    kept = out.detach().cpu() != 0
    rate = 1 - kept.float().mean().item()
    assert abs(rate - p) < 0.03, rate  # 8192 draws: the rate's standard error is 0.005
    assert torch.allclose(out.detach().cpu()[kept], x_cpu[kept] / (1 - p), rtol=1e-6)
    # the backward redraws the forward's mask
    assert torch.equal(x.grad.cpu() != 0, kept)
    assert torch.allclose(x.grad.cpu()[kept], torch.full_like(x_cpu[kept], 1 / (1 - p)), rtol=1e-6)
    torch.manual_seed(5)
    again, _ = module(x.detach())
    assert torch.equal(again.cpu(), out.detach().cpu())  # reproducible under a seed
    other, _ = module(x.detach())
    assert not torch.equal(other.cpu(), out.detach().cpu())  # a fresh mask per call
    module.eval()
    evaluated, _ = module(x.detach())
    assert torch.allclose(evaluated.cpu(), x_cpu, rtol=1e-6)  # no dropout in eval


def test_dropout_with_the_cpu_when_it_cannot_change_a_value():
    # dropout > 0 in eval mode, and a one-layer module (no layer to drop between), equal the CPU's exactly
    for kwargs, train in (({"num_layers": 2, "dropout": 0.5}, False), ({"dropout": 0.0}, True)):
        module = _module(nn.LSTM, **kwargs).train(train)
        expected, _ = _run(module, "cpu", _input(False), None)
        got, _ = _run(module, "tpu", _input(False), None)
        assert all(_rel(a, b) < 1e-5 for a, b in zip(got, expected))


def _fused_graph_ops(steps):
    module = _module(nn.GRU, num_layers=2).to("tpu")
    x = torch.randn(steps, B, IN).to("tpu")
    before = {e.id for e in executables.all()}
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
        out, h = module(x)
        (out.sum() + h.sum()).backward()
        module.weight_hh_l1.grad.sum().item()
    fused = [e for e in executables.all() if e.id not in before and e.kind == "fused"]
    return [op for e in fused for op in e.ops]


def test_fused_mode_records_a_sequence_as_one_op_whatever_its_length():
    short, long = _fused_graph_ops(4), _fused_graph_ops(32)
    assert short.count(str(RNN)) == 1 and short.count(str(RNN_BACKWARD)) == 1
    assert len(short) == len(long)  # the graph does not grow with the sequence


def test_a_compiled_model_replays_the_sequence_as_its_forward_and_backward_programs():
    module = _module(nn.LSTM, num_layers=2, batch_first=True)
    x = _input(True)
    out = module(x)[0]
    out.sum().backward()
    expected = [out.detach(), *(p.grad for p in module.parameters())]
    tpu = _module(nn.LSTM, num_layers=2, batch_first=True).to("tpu")
    compiled = torch.compile(tpu)
    for step in range(4):  # captured, confirmed, then replayed
        tpu.zero_grad(set_to_none=True)
        before = executables.snapshot()
        out = compiled(x.to("tpu"))[0]
        out.sum().backward()
    ran = {e.name for e in executables.all() if e.calls != before.get(e.id, (0, 0.0))[0]}
    assert {"compiled_module_forward", "compiled_module_backward"} <= ran
    assert not any(name.startswith("tpu_agent.") or "fused_graph" in name for name in ran), ran
    recorded = [e for e in executables.all() if str(RNN) in e.ops]  # the captures' graphs
    assert recorded and all(e.ops.count(str(RNN)) == 1 for e in recorded)
    got = [out.detach().cpu(), *(p.grad.cpu() for p in tpu.parameters())]
    for a, b in zip(got, expected):
        assert _rel(a, b) < 1e-5


class _Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(IN, HID, num_layers=2, bidirectional=True, batch_first=True)
        self.head = nn.Linear(2 * HID, 3)

    def forward(self, x):
        return torch.log_softmax(self.head(self.rnn(x)[0]), dim=-1)


def _train(device, compiled, n=6):
    from tpu_agent.backend.compiled import auto_compile

    torch.manual_seed(0)
    model = _Tagger().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(B, T, IN, generator=g).to(device), torch.randint(0, 3, (B, T), generator=g).to(device)
    auto_compile.compile_steps(compiled)
    try:
        losses = []
        for _ in range(n):
            loss = nn.functional.nll_loss(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    finally:
        auto_compile.compile_steps(False)
    return losses, model


def test_compiled_steps_train_a_recurrent_model_with_the_cpus_losses():
    cpu, _ = _train("cpu", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tpu, model = _train("tpu", True)
    assert not [w for w in caught if "cannot be one program" in str(w.message)]
    assert "forward" in model.__dict__, "the model's forward was not compiled"
    assert tpu == pytest.approx(cpu, rel=1e-5)


def test_autocast_runs_the_sequence_in_the_autocast_dtype_with_float32_gradients():
    # as CUDA's autocast runs cuDNN's RNN (and as the cells run under autocast): bfloat16 in, bfloat16 out
    module = _module(nn.LSTM, num_layers=2)
    x = _input(False)
    expected, _ = _run(module, "cpu", x, None)
    tpu = module.to("tpu")
    with torch.autocast("tpu", dtype=torch.bfloat16):
        out, (h, c) = tpu(x.to("tpu"))
    assert out.dtype == h.dtype == c.dtype == torch.bfloat16
    ((out.float() ** 2).sum() + (h.float() ** 2 * 0.5).sum() + (c.float() ** 2 * 0.5).sum()).backward()
    assert tpu.weight_ih_l0.grad.dtype == torch.float32
    assert _rel(out.float().cpu(), expected[0]) < 3e-2
    assert _rel(tpu.weight_hh_l1.grad.cpu(), expected[-3]) < 5e-2  # weight_hh_l1 (parameters last, in order)
