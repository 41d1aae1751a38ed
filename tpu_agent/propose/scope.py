"""What the search may change: `exact` and `numerics` always; `model` and `training` when `--allow` opens them;
the user's data never; a knob whose value the run does not use (overridden, or sizing nothing the profile saw)
never. Knobs and candidates outside are left out here, each with one line saying why."""

from __future__ import annotations

from collections.abc import Sequence

from tpu_agent.propose.base import ProposalRound
from tpu_agent.propose.knobs import Knob

ALWAYS = ("exact", "numerics")


def searched(allow: Sequence[str]) -> set[str]:
    return {*ALWAYS, *allow} - {"data"}


def knobs_in_scope(knobs: Sequence[Knob], allow: Sequence[str]) -> tuple[list[Knob], list[tuple[Knob, str]]]:
    """The knobs a proposer may rewrite, and each one left out with a line saying why (ranked as the knobs were)."""
    open_ = searched(allow)
    kept, out = [], []
    for k in knobs:
        if k.effect != "data" and (k.overridden or k.unused):  # rewriting it changes nothing the run builds
            out.append((k, f"{k.label}: not searched, {k.overridden or k.unused}"))
        elif k.effect in open_:
            kept.append(k)
        elif k.effect == "data":
            out.append((k, f"{k.label}: not proposed, {k.effect_why} (the tuner never changes the data)"))
        else:
            out.append((k, f"{k.label}: not searched, a {k.effect} change ({k.effect_why}); `--allow {k.effect}` "
                           "searches it"))
    return kept, out


def candidates_in_scope(round_: ProposalRound, allow: Sequence[str]) -> tuple[ProposalRound, list[str]]:
    """The round without candidates that would make a change of a class not searched (a proposer that ignored
    the knobs' classes, or Claude writing a pad_dim of its own)."""
    open_ = searched(allow)
    kept, out = [], []
    for cand in round_.candidates:
        try:
            effects = {a.effect for option in cand.options() for a in option}
        except ValueError:
            kept.append(cand)  # an invalid candidate: the search space leaves it out, and says so
            continue
        closed = sorted(effects - open_)
        if not closed:
            kept.append(cand)
            continue
        how = ("the tuner never changes the data" if closed == ["data"]
               else f"`--allow {','.join(e for e in closed if e != 'data')}` searches it")
        out.append(f"candidate {cand.title!r}: not searched, a {'/'.join(closed)} change ({how})")
    return round_.model_copy(update={"candidates": kept}), out
