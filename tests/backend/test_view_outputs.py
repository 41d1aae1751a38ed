"""Compiled steps and `torch.compile` on modules whose forward returns views (module_program.py): an unbatched
input's `squeeze(0)`, attention's transposed output, a recurrent layer's output slices are the program's own
outputs (one program, not the forward run as written); a view of an argument or of another returned tensor still
aliases it, as on the CPU. Real models: an nn.TransformerEncoder and an nn.LSTM language model train with the CPU's
losses and one program per step."""

from __future__ import annotations

import warnings

import pytest
import torch

from tpu_agent.backend.compiled import auto_compile
from tpu_agent.backend.core import executables


def _compiled(module, whole_step: bool = False):
    """`torch.compile(module)` (whole_step False), or as compiled steps compile the model they find: a call with
    gradients opens a step window, its programs recorded into the step's one program until `mark_step`."""
    return auto_compile.compile_module(module, whole_step=whole_step)


def _twice(compiled, *args):
    """Two calls: the first captures, the second captures again and agrees, so later calls replay."""
    for _ in range(2):
        compiled._orig_mod(*args)
        torch.tpu.mark_step()


class Transposed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 6)

    def forward(self, x):
        return self.lin(x).transpose(0, 1)[1:]  # a view (two links) of a computed tensor


def test_a_view_of_a_computed_tensor_is_an_output_of_the_program():
    torch.manual_seed(0)
    cpu = Transposed()
    tpu = Transposed().to("tpu")
    tpu.load_state_dict(cpu.state_dict())
    compiled = _compiled(tpu)
    x = torch.randn(5, 4)
    xt = x.to("tpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a forward that cannot be one program warns
        _twice(compiled, xt)
        replays = compiled.replays
        out = tpu(xt.requires_grad_())
    assert compiled.reason_not_compiled is None and compiled.replays == replays + 1
    expected = cpu(x.requires_grad_())
    assert out.shape == expected.shape and out.dtype == expected.dtype
    # The view's value, contiguous: what the same view reports in eager mode on tpu.
    eager = Transposed().to("tpu")
    eager.load_state_dict(cpu.state_dict())
    assert out.stride() == eager(xt.detach()).stride() and out.is_contiguous()
    torch.testing.assert_close(out.detach().cpu(), expected.detach())
    g = torch.randn(expected.shape)
    expected.backward(g)
    out.backward(g.to("tpu"))
    torch.testing.assert_close(xt.grad.cpu(), x.grad)
    torch.testing.assert_close(tpu.lin.weight.grad.cpu(), cpu.lin.weight.grad)
    # An in-place write on the output reaches nothing else: the next call computes the same values.
    with torch.no_grad():
        out.add_(100.0)
        again = tpu(xt)
    torch.testing.assert_close(again.cpu(), expected.detach())
    torch.testing.assert_close(tpu.lin.weight.cpu(), cpu.lin.weight.detach())
    auto_compile.STATE.modules.clear()


class Aliasing(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, n: int):
        y = self.lin(x)
        return y, y[0], x[:, :n], self.lin.weight.t()


@pytest.mark.parametrize("whole_step", [False, True], ids=["torch-compile", "compiled-steps"])
def test_views_of_arguments_parameters_and_other_outputs_keep_aliasing_them(whole_step):
    torch.manual_seed(0)
    cpu = Aliasing()
    tpu = Aliasing().to("tpu")
    tpu.load_state_dict(cpu.state_dict())
    compiled = _compiled(tpu, whole_step)
    x = torch.randn(3, 4)
    xt = x.to("tpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _twice(compiled, xt, 2)
        replays = compiled.replays
        outs = tpu(xt.requires_grad_(), 2)
        assert compiled.replays == replays + 1
        expected = cpu(x.requires_grad_(), 2)
        # Gradients through each output, the views of the argument and of the parameter included.
        gs = [torch.randn(e.shape) for e in expected]
        torch.autograd.backward(expected, gs)
        torch.autograd.backward(outs, [g.to("tpu") for g in gs])
        torch.tpu.mark_step()  # the step's end (compiled steps: its one program runs)
        for a, e in zip(outs, expected):
            assert a.shape == e.shape
            torch.testing.assert_close(a.detach().cpu(), e.detach())
        torch.testing.assert_close(xt.grad.cpu(), x.grad)
        torch.testing.assert_close(tpu.lin.weight.grad.cpu(), cpu.lin.weight.grad)
        torch.testing.assert_close(tpu.lin.bias.grad.cpu(), cpu.lin.bias.grad)
        # A write into a view shows in what it views, as on the CPU: the other output, the argument, the weight.
        with torch.no_grad():
            for out in (outs, expected):
                out[1].fill_(7.0)
                out[2].fill_(-1.0)
                out[3][0, 0] = 5.0
        torch.testing.assert_close(outs[0].detach().cpu(), expected[0].detach())
        torch.testing.assert_close(xt.detach().cpu(), x.detach())
        torch.testing.assert_close(tpu.lin.weight.detach().cpu(), cpu.lin.weight.detach())
        # Another slice width is another program (the host's view holds the number), not the last one's view.
        assert tpu(xt, 3)[2].shape == (3, 3)
        torch.tpu.mark_step()
    auto_compile.STATE.modules.clear()


# --- real models under compiled steps -------------------------------------------------------------------------
VOCAB, D, T, B = 40, 16, 12, 4


class EncoderLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, D)
        layer = torch.nn.TransformerEncoderLayer(D, nhead=4, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(D, VOCAB)

    def forward(self, tokens):
        mask = torch.nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=tokens.device)
        return self.head(self.encoder(self.emb(tokens), mask=mask, is_causal=True))


class LSTMLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, D)
        self.lstm = torch.nn.LSTM(D, D, num_layers=2)  # (time, batch, features), as the word-language model
        self.head = torch.nn.Linear(D, VOCAB)

    def forward(self, tokens):
        out, _ = self.lstm(self.emb(tokens))
        return self.head(out)


def _launches() -> int:
    return sum(e.calls for e in executables.all())


def _train(model_cls, device: str, steps: int, compiled: bool = False):
    torch.manual_seed(0)
    model = model_cls().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, VOCAB, (B, T + 1), generator=g) for _ in range(steps)]
    if model_cls is LSTMLM:
        data = [d.t().contiguous() for d in data]  # time first
    data = [d.to(device) for d in data]
    losses, programs = [], []
    if compiled:
        auto_compile.compile_steps(True)
    try:
        for d in data:
            x, y = (d[:, :-1], d[:, 1:]) if model_cls is EncoderLM else (d[:-1], d[1:])
            before = _launches()
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            programs.append(_launches() - before)
    finally:
        auto_compile.compile_steps(False)
        auto_compile.STATE.modules.clear()
    return losses, programs, model


@pytest.mark.parametrize("model_cls", [EncoderLM, LSTMLM], ids=["transformer-encoder", "lstm"])
def test_attention_and_lstm_models_train_as_one_program_per_step(model_cls):
    steps = 4  # the model is found at step 1 and captured at steps 2 and 3 (two captures must agree)
    cpu, _, _ = _train(model_cls, "cpu", steps)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a module that cannot be one program warns
        tpu, programs, model = _train(model_cls, "tpu", steps, compiled=True)
    assert tpu == pytest.approx(cpu, rel=1e-5, abs=1e-6)
    compiled = model.forward.__self__
    assert compiled.reason_not_compiled is None and compiled.replays >= 1
    assert programs[-1] == 1, programs
