"""PyTorch's module database (module_db, what PyTorch's own test_modules.py runs on every device) on the tpu device
against the CPU: outputs, buffers after the forward, gradients of inputs and parameters (training mode), and a
state_dict round trip through the CPU, in training mode and in eval mode under `torch.no_grad()`
(tests/backend/module_db_check.py does the comparing).

One test per module and mode, in this process (the programs its ops compile are reused by the next module):
every module in eager mode, the modules in MARKED in fused and compiled-steps modes. The suite's time: each module
checks at most EAGER_MOST inputs per training mode (MARKED_MOST in the other modes), spread over its list, from
first to last; `python tests/backend/module_db_check.py [eager|fused|compiled]` checks all of them.

A case that fails today is marked xfail(strict=True) with its cause: when a fix makes it pass, the mark must go.
"""

from __future__ import annotations

import pytest

import module_db_check

EAGER_MOST = 2
MARKED_MOST = 2
# Fused and compiled steps: a module of each family (the program a model's step becomes holds these).
MARKED = ["nn.Linear", "nn.Bilinear", "nn.Conv2d", "nn.ConvTranspose1d", "nn.BatchNorm2d", "nn.GroupNorm",
          "nn.LayerNorm", "nn.RMSNorm", "nn.InstanceNorm1d", "nn.Embedding", "nn.MaxPool2d",
          "nn.AdaptiveAvgPool2d", "nn.GELU", "nn.PReLU", "nn.CrossEntropyLoss", "nn.MultiheadAttention",
          "nn.TransformerEncoderLayer", "nn.LSTM", "nn.GRUCell", "nn.LazyConv2d"]

# (module, mode) -> why it fails today; mode None: every mode it runs in. Empty: every case passes in every mode,
# compiled steps included (a forward that returns views, an unbatched input's squeeze, attention's transposed
# output, a recurrent layer's output slices, is one program too: module_program.py).
XFAIL: dict[tuple[str, str | None], str] = {}


# module_db's modules, in its order (a test checks this list against it: importing module_db at collection would
# cost every pytest run seconds).
NAMES = [
    'nn.AdaptiveAvgPool1d', 'nn.AdaptiveAvgPool2d', 'nn.AdaptiveAvgPool3d', 'nn.AdaptiveMaxPool1d',
    'nn.AdaptiveMaxPool2d', 'nn.AdaptiveMaxPool3d', 'nn.AvgPool1d', 'nn.AvgPool2d', 'nn.AvgPool3d',
    'nn.BatchNorm1d', 'nn.BatchNorm2d', 'nn.BatchNorm3d', 'nn.CELU', 'nn.Conv1d', 'nn.Conv2d', 'nn.Conv3d',
    'nn.ConvTranspose1d', 'nn.ConvTranspose2d', 'nn.ConvTranspose3d', 'nn.CosineEmbeddingLoss', 'nn.ELU',
    'nn.FractionalMaxPool2d', 'nn.FractionalMaxPool3d', 'nn.L1Loss', 'nn.SmoothL1Loss', 'nn.LazyConv1d',
    'nn.LazyConv2d', 'nn.LazyConv3d', 'nn.LazyConvTranspose1d', 'nn.LazyConvTranspose2d', 'nn.LazyConvTranspose3d',
    'nn.Linear', 'nn.Bilinear', 'nn.LPPool1d', 'nn.LPPool2d', 'nn.LPPool3d', 'nn.MaxPool1d', 'nn.MaxPool2d',
    'nn.MaxPool3d', 'nn.KLDivLoss', 'nn.MSELoss', 'nn.MarginRankingLoss', 'nn.MultiLabelMarginLoss',
    'nn.MultiMarginLoss', 'nn.SoftMarginLoss', 'nn.MultiLabelSoftMarginLoss', 'nn.NLLLoss', 'nn.GaussianNLLLoss',
    'nn.PoissonNLLLoss', 'nn.HingeEmbeddingLoss', 'nn.HuberLoss', 'nn.BCELoss', 'nn.BCEWithLogitsLoss',
    'nn.CrossEntropyLoss', 'nn.LinearCrossEntropyLoss', 'nn.CTCLoss', 'nn.GELU', 'nn.GLU', 'nn.GroupNorm',
    'nn.Hardshrink', 'nn.Hardswish', 'nn.Hardtanh', 'nn.InstanceNorm1d', 'nn.InstanceNorm2d', 'nn.InstanceNorm3d',
    'nn.LocalResponseNorm', 'nn.LayerNorm', 'nn.RMSNorm', 'nn.TransformerEncoder', 'nn.TransformerEncoderLayer',
    'nn.TransformerDecoderLayer', 'nn.Transformer', 'nn.MultiheadAttention', 'nn.Embedding', 'nn.ReLU',
    'nn.LeakyReLU', 'nn.ReLU6', 'nn.PReLU', 'nn.RNNCell', 'nn.GRUCell', 'nn.LSTMCell', 'nn.Sigmoid',
    'nn.LogSigmoid', 'nn.SiLU', 'nn.Softmax', 'nn.Softmax2d', 'nn.LogSoftmax', 'nn.Softmin', 'nn.Softplus',
    'nn.Softshrink', 'nn.Softsign', 'nn.Tanh', 'nn.Tanhshrink', 'nn.Threshold', 'nn.Mish', 'nn.RNN', 'nn.GRU',
    'nn.LSTM', 'nn.ReflectionPad1d', 'nn.ReflectionPad2d', 'nn.ReflectionPad3d', 'nn.ReplicationPad1d',
    'nn.ReplicationPad2d', 'nn.ReplicationPad3d', 'nn.SELU', 'nn.ZeroPad1d', 'nn.ZeroPad2d', 'nn.ZeroPad3d',
    'nn.CircularPad1d', 'nn.CircularPad2d', 'nn.CircularPad3d', 'nn.ConstantPad1d', 'nn.ConstantPad2d',
    'nn.ConstantPad3d'
]


@pytest.fixture(scope="module")
def infos() -> dict:
    return module_db_check.module_infos()


def _cases():
    for name in NAMES:
        for mode in module_db_check.MODES:
            if mode != "eager" and name not in MARKED:
                continue
            reason = XFAIL.get((name, mode)) or XFAIL.get((name, None))
            # A case marked for running as written still fails on any value that differs from the CPU's.
            ran_as_written = pytest.mark.xfail(reason=reason, strict=True, raises=module_db_check.RanAsWritten)
            marks = [ran_as_written] if reason else []
            yield pytest.param(name, mode, id=f"{name}-{mode}", marks=marks)


def test_every_module_of_module_db_is_checked(infos):
    assert NAMES == list(infos), "module_db changed: update NAMES"
    unknown = sorted({n for n in MARKED if n not in infos} | {n for n, _ in XFAIL if n not in infos})
    assert not unknown, f"not in module_db: {unknown}"


@pytest.mark.parametrize("name,mode", list(_cases()))
def test_module_matches_the_cpu(name, mode, infos):
    result = module_db_check.check_module(infos[name], mode, EAGER_MOST if mode == "eager" else MARKED_MOST)
    assert result.cases, f"{name}: no float32 input was checked"
    failures = "\n".join(f"{c.name}: {c.error}" for c in result.failures)
    if result.failures and all(c.error.startswith("RanAsWritten:") for c in result.failures):
        raise module_db_check.RanAsWritten(f"{len(result.failures)} of {len(result.cases)} cases ran as written "
                                           f"(their values match the CPU's):\n{failures}")
    assert result.ok, f"{len(result.failures)} of {len(result.cases)} cases differ from the CPU:\n{failures}"
