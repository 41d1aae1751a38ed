"""Autocast on `tpu`: kernels for the `AutocastPrivateUse1` dispatch key.

`torch.autocast("tpu")` turns that key on, and PyTorch registers nothing there for a
PrivateUse1 backend. The op lists are the ones ATen keeps for other backends to reuse
(`AT_FORALL_*` in ATen/autocast_mode.h, torch 2.13; CUDA uses them): matmul-like ops run
in the autocast dtype, numerically sensitive ops in float32, a few ops in the widest
input type, and every other op falls through unchanged. Only floating `tpu` tensors other
than float64 are cast, as in ATen. The default autocast dtype on tpu is bfloat16.
"""

from __future__ import annotations

import torch

# AT_FORALL_LOWER_PRECISION_FP
LOWER_PRECISION_FP = (
    "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc",
    "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input", "convolution",
    "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv", "linalg_vecdot",
    "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
    "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell",
    "rnn_tanh_cell", "rnn_relu_cell", "_scaled_dot_product_flash_attention",
    "scaled_dot_product_attention",
)

# AT_FORALL_FP32
FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
    "reciprocal", "rsqrt", "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor",
    "pow.Scalar", "softplus", "layer_norm", "native_layer_norm", "rms_norm", "group_norm",
    "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim", "cosine_similarity",
    "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
    "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss",
    "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist",
    "pdist", "cdist", "renorm", "logsumexp", "upsample_nearest1d", "_upsample_nearest_exact1d",
    "upsample_nearest2d", "_upsample_nearest_exact2d", "upsample_nearest3d",
    "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
    "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d",
    "_upsample_bicubic2d_aa",
)

# AT_FORALL_FP32_SET_OPT_DTYPE: float32 through the op's own `dtype` argument, unless given.
FP32_SET_OPT_DTYPE = (
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum",
    "linalg_vector_norm", "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum",
    "sum.dim_IntList",
)

# AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE: an overload without dtype -> the one with it.
FP32_APPEND_DTYPE = {"norm.Scalar": "norm.ScalarOpt_dtype", "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype"}

# AT_FORALL_PROMOTE
PROMOTE = (
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler",
    "index_put", "tensordot", "scatter_add",
)

BANNED = {
    "binary_cross_entropy": (
        "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
        "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
        "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
        "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
        "safe to autocast."
    ),
}

DEVICE = "tpu"
_AUTOCAST_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)
for _key in ("AutocastCPU", "AutocastCUDA", "AutocastXPU", "AutocastMPS", "AutocastHPU", "AutocastIPU"):
    if hasattr(torch._C.DispatchKey, _key):
        _AUTOCAST_KEYS = _AUTOCAST_KEYS | torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, _key))

_libraries: list = []


def _overload(name: str):
    packet, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, packet), overload or "default")


def _eligible(arg) -> bool:
    return (isinstance(arg, torch.Tensor) and arg.device.type == DEVICE and arg.is_floating_point()
            and arg.dtype != torch.float64)


def _cast(arg, dtype):
    if _eligible(arg):
        return arg if arg.dtype == dtype else arg.to(dtype)
    if isinstance(arg, (list, tuple)):
        return type(arg)(_cast(a, dtype) for a in arg)
    return arg


def _tensors(args, kwargs):
    for a in (*args, *kwargs.values()):
        if isinstance(a, (list, tuple)):
            yield from (x for x in a if isinstance(x, torch.Tensor))
        elif isinstance(a, torch.Tensor):
            yield a


def _call_cast(op, dtype, args, kwargs):
    with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_KEYS):
        args, kwargs = _cast(args, dtype), {k: _cast(v, dtype) for k, v in kwargs.items()}
        return op(*args, **kwargs)


def _cast_all(op, dtype):
    """Every eligible input cast to `dtype` (a dtype, or a function giving the current one)."""

    def kernel(*args, **kwargs):
        return _call_cast(op, dtype() if callable(dtype) else dtype, args, kwargs)

    return kernel


def _set_opt_dtype(op):
    names = [a.name for a in op._schema.arguments]

    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_KEYS):
            if not (args and _eligible(args[0])):
                return op(*args, **kwargs)
            position = names.index("dtype")
            if position < len(args):
                if args[position] is None:
                    args = (*args[:position], torch.float32, *args[position + 1:])
            elif kwargs.get("dtype") is None:
                kwargs = {**kwargs, "dtype": torch.float32}
            return op(*args, **kwargs)

    return kernel


def _append_dtype(target):
    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_KEYS):
            first = args[0]
            dtype = torch.float32 if _eligible(first) else first.dtype
            return target(*args, **kwargs, dtype=dtype)

    return kernel


def _promote(op):
    def kernel(*args, **kwargs):
        widest = torch.get_autocast_dtype(DEVICE)
        for t in _tensors(args, kwargs):
            if _eligible(t):
                widest = torch.promote_types(widest, t.dtype)
        return _call_cast(op, widest, args, kwargs)

    return kernel


def _banned(message):
    def kernel(*args, **kwargs):
        raise RuntimeError(message)

    return kernel


def _lower_precision():
    return torch.get_autocast_dtype(DEVICE)


def register() -> None:
    """Register the kernels and the fallthrough, and make bfloat16 tpu's default autocast dtype."""
    if _libraries:
        return
    key = "AutocastPrivateUse1"
    fallback = torch.library.Library("_", "IMPL")
    fallback.fallback(torch.library.fallthrough_kernel, key)
    lib = torch.library.Library("aten", "IMPL")
    kernels = {}
    kernels.update({name: _cast_all(_overload(name), _lower_precision) for name in LOWER_PRECISION_FP})
    kernels.update({name: _cast_all(_overload(name), torch.float32) for name in FP32})
    kernels.update({name: _set_opt_dtype(_overload(name)) for name in FP32_SET_OPT_DTYPE})
    kernels.update({name: _append_dtype(_overload(target)) for name, target in FP32_APPEND_DTYPE.items()})
    kernels.update({name: _promote(_overload(name)) for name in PROMOTE})
    kernels.update({name: _banned(message) for name, message in BANNED.items()})
    for name, kernel in kernels.items():
        lib.impl(name, kernel, key)
    _libraries.extend((fallback, lib))
    torch.set_autocast_dtype(DEVICE, torch.bfloat16)
