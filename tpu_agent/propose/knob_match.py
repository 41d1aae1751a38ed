"""What a baseline profile says about each knob: the ops its value appears in, the padding report's figures for
it, and the modules built with it.

Matching is by value (the knob's value, or one computed from it such as
`3 * D_MODEL`): two knobs with the same value share their matches. The
modules come from the profile's `modules` (the constructor sizes of the
modules the script built, read at run time); a model dim that sizes a
module or a tensor directly (not only through view/reshape, whose values
the ops may merge: batch x heads) and whose value sizes no module and
appears in no op is marked `unused` and never searched: the value the
script writes is not the one the run builds (a default passed over by a
config the finder did not follow, say). The batch size sizes no module:
it is never tied to one.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

MAX_MODULES = 8  # module groups listed per knob (each a class and its sizes)


def _dims(shape: str) -> set[int]:
    return {int(d) for group in re.findall(r"\[([\d,\s]*)\]", shape) for d in group.replace(" ", "").split(",") if d}


def _profile_ops(profile) -> list[tuple[set[int], float]]:
    """(dims, share of the step's FLOPs) of every hot op, and of every dot/conv in the padding report not among them."""
    ops = {(op.executable, op.instruction): (_dims(" ".join([op.shape, *op.operands])), op.share)
           for op in profile.hot_ops}
    total = profile.flops.per_step if profile.flops is not None and profile.flops.per_step else None
    if profile.padding is not None and total:
        for op in profile.padding.ops:
            key = (op.executable, op.instruction)
            if key not in ops:
                ops[key] = (_dims(f"{op.lhs} {op.rhs}") | {op.m, op.k, op.n}, op.flops_per_step / total)
    return list(ops.values())


def match_profile(knobs: Sequence, profile, sizing: set[str] = frozenset()) -> None:
    """Fill each Knob's profile fields: matched_ops, flop_share, padded_to, padding_waste, modules, unused.
    `sizing`: the ids of knobs with a direct size use, the only ones that can be unused."""
    ops = _profile_ops(profile)
    padding = {d.size: d for d in profile.padding.dims} if profile.padding is not None else {}
    built = profile.modules
    for knob in knobs:
        values = {knob.value, *knob.derived}
        hits = [share for dims, share in ops if dims & values]
        knob.matched_ops = len(hits)
        knob.flop_share = min(1.0, sum(hits))
        for v in sorted(values):
            if v in padding:
                knob.padded_to = padding[v].padded_to
                knob.padding_waste = padding[v].share_of_padded_work
                break
        if built is None or knob.batch:
            continue  # a profile from before modules were recorded, or the batch: nothing to tie
        sized = [m for m in built.sizes if values & m.values()]
        knob.modules = [m.describe() for m in sized[:MAX_MODULES]]
        can_be_unused = knob.effect == "model" and knob.id in sizing and not knob.overridden and built.sizes
        if can_be_unused and not sized and not hits:
            shown = ", ".join(str(v) for v in sorted(values))
            knob.unused = (f"sizes nothing at run time: no module of {', '.join(built.models) or 'the model'} was "
                           f"built with {shown}, and no op of the profile has it")
