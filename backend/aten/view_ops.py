"""View ops on tpu tensors: the result shares its source's storage and extends its view chain.

The view's value is computed by its lowering like any op's; what makes it a view is the link kept here, so
that a later write to the base shows through the view and a write to the view reaches the base (views.py).
In-place metadata ops (`t_`, `squeeze_`...) turn a tensor into such a view of its own storage.
"""

from __future__ import annotations

import torch

from ..core import modes
from .execute import execute
from .fallback import decompose, unsupported
from ..core.lazy import RECORDER, Lazy
from ..core.registry import LOWERINGS
from ..core.state import STATE
from ..core.tensor import TpuTensor
from ..core.views import chain_entry

aten = torch.ops.aten

# Views that are the same array: they share the source's storage and chain, no op runs.
ALIAS_OPS = {aten.detach.default, aten.alias.default, aten.lift_fresh.default}


def run_view(func, args, kwargs):
    if func in ALIAS_OPS:
        source = args[0]
        return TpuTensor(source.jax(), storage=source._storage_box, chain=source._view_chain)
    lowering = LOWERINGS.get(func)
    if lowering is None:
        decomposed = decompose(func, args, kwargs)
        if decomposed is not NotImplemented:
            return decomposed
        return unsupported(func, args, kwargs)
    source = args[0] if args else kwargs.get("self")
    if _index_view_of_concrete(func, source):
        # A batch sliced from a dataset tensor: computed now, so fused graphs take it as an
        # input instead of baking the index in (one graph for every batch, not one per index).
        with modes.eager_override():
            out = execute(func, lowering, args, kwargs)
    else:
        out = execute(func, lowering, args, kwargs)
    if not isinstance(source, TpuTensor):
        return out
    outs = out if isinstance(out, (list, tuple)) else [out]
    for index, view in enumerate(outs):
        entry = chain_entry(func, args, kwargs, index if isinstance(out, (list, tuple)) else None)
        view._cache = view._storage_box.array  # its value, made by the op; the storage becomes its source's
        view._storage_box = source._storage_box
        view._view_chain = source._view_chain + (entry,)
        view._cache_version = source._storage_box.version
    return out


INDEX_VIEWS = {aten.select.int, aten.slice.Tensor, aten.narrow.default, aten.unbind.int,
               aten.split.Tensor, aten.split_with_sizes.default, aten.diagonal.default}


def _index_view_of_concrete(func, source) -> bool:
    if func not in INDEX_VIEWS or not STATE.fused or RECORDER.capture is not None:
        return False
    return isinstance(source, TpuTensor) and type(source.jax()) is not Lazy


def _metadata_inplace_ops():
    pairs = {"t_": "t", "transpose_": "transpose", "squeeze_": "squeeze", "unsqueeze_": "unsqueeze",
             "swapdims_": "transpose", "swapaxes_": "transpose", "as_strided_": "as_strided"}
    table = {}
    for inplace, view in pairs.items():
        packet, view_packet = getattr(aten, inplace), getattr(aten, view)
        for name in packet.overloads():
            target = name if name in view_packet.overloads() else ("int" if "int" in view_packet.overloads() else "default")
            table[getattr(packet, name)] = getattr(view_packet, target)
    return table


METADATA_INPLACE = _metadata_inplace_ops()


def run_metadata_inplace(func, args, kwargs):
    """`t_`, `squeeze_`...: the tensor becomes a view of its own storage with a new shape.

    Our wrapper's shape lives on its C++ (meta) side: the op runs there with our dispatch
    off to update it, and the tensor's view chain gains the matching view op.
    """
    self = args[0]
    view = run_view(METADATA_INPLACE[func], args, kwargs)
    with torch._C._DisableTorchDispatch():
        func(*args, **kwargs)
    self._view_chain, self._cache, self._cache_version = view._view_chain, view._cache, view._cache_version
    return self
