"""The offline proposer: playbooks matched against the profile and the knobs, ranked deterministically.

Same input, same output: no clock, no randomness, no network. Ranking is by
tier (1: the padding report or a measured bottleneck points at it, 2: other
profile evidence, 3: generic advice), then by score (the estimated share of the step the
change would save, times the playbook's confidence), then by id. Scores that
come from the padding report are estimates of a TPU's tile padding, and the
evidence says so.
"""

from __future__ import annotations

from typing import Any, ClassVar, Sequence

from tpu_agent.profilers.padding import round_up
from tpu_agent.profilers.schema import PaddingDim, Profile
from tpu_agent.propose.base import ProposalRound, Proposer, TrialOutcome
from tpu_agent.propose.candidates import ActionTemplate, Candidate, Evidence, action_key, numerics_preserved
from tpu_agent.propose.conditions import METRICS, name_words, substitute, variables
from tpu_agent.propose.knobs import Knob
from tpu_agent.propose.playbook import Generator, Playbook, builtin_playbooks

NAME = "offline"
MAX_HEAD_CHOICES = 3


def _dim_evidence(dim: PaddingDim) -> Evidence:
    more = f" (+{len(dim.ops) - 1} more)" if len(dim.ops) > 1 else ""
    where = f" in {dim.ops[0]}{more}" if dim.ops else ""
    return Evidence(
        what=(f"dim {dim.size} ({','.join(dim.roles)}) pads to {dim.padded_to}: {dim.share_of_padded_work:.2%} "
              f"of the padded dot/conv work, {dim.wasted_flops_per_step.value:.3g} FLOP/step (estimate){where}"),
        op=dim.ops[0] if dim.ops else None, dim=",".join(dim.roles), size=dim.size, padded_to=dim.padded_to,
        waste=dim.share_of_padded_work, wasted_flops_per_step=dim.wasted_flops_per_step.value, estimate=True,
    )


def _select_dims(pb: Playbook, profile: Profile) -> list[PaddingDim]:
    sel = pb.targets.dims
    if profile.padding is None:
        return []
    return [d for d in profile.padding.dims
            if d.size >= sel.min_size and d.share_of_padded_work >= sel.min_share
            and (sel.max_growth is None or d.padded_to <= d.size * (1 + sel.max_growth))
            and (sel.roles_any is None or set(sel.roles_any) & set(d.roles))]


def _sets(knob: Knob, size: int) -> bool:
    """The knob sets a dim of this size: its value is that size."""
    return knob.value == size


class _Binding:
    """A knob a playbook would rewrite, the dims that point at it, and (head_dim) the width knob."""

    def __init__(self, knob: Knob, dims: list[PaddingDim], width: Knob | None = None):
        self.knob, self.dims, self.width = knob, dims, width


def _width_first(k: Knob):
    """For width / heads: model-width names (d_model, n_embd, hidden, width, dim) before other knobs."""
    named = any(w.startswith(("model", "embd", "embed", "hidden", "width", "dim")) for w in name_words(k.name or ""))
    return (not named, k.file, k.line, k.column)


def _bind_knobs(pb: Playbook, dims: list[PaddingDim], knobs: list[Knob]) -> list[_Binding]:
    sel = pb.targets.knobs
    keep = [k for k in knobs if sel.keeps(k.name, k.batch) and not k.overridden]
    out = []
    groups: set[str] = set()
    for knob in sorted(keep, key=lambda k: (k.file, k.line, k.column)):
        if knob.group is not None:
            if knob.group in groups:
                continue  # its group's first literal stands for it (they are padded together)
            groups.add(knob.group)
        if sel.match == "dim":
            hit = [d for d in dims if _sets(knob, d.size)]
            if hit:
                out.append(_Binding(knob, hit))
            continue
        # head_dim: a head-dim literal equal to the dim, or a heads count with width / heads == the dim.
        literal = [d for d in dims if _sets(knob, d.size)]
        if literal:
            out.append(_Binding(knob, literal))
            continue
        for width in sorted(knobs, key=_width_first):
            if width is knob or knob.value <= 0 or width.value % knob.value:
                continue
            hit = [d for d in dims if width.value // knob.value == d.size]
            if hit:
                out.append(_Binding(knob, hit, width))
                break
    return out


def _generate(gen: Generator, binding: _Binding, env: dict[str, int]) -> list[int]:
    value = binding.knob.value
    if gen.round_up_to is not None:
        values = {round_up(value, int(substitute(m, env))) for m in gen.round_up_to}
    elif gen.knob_aligned:
        values = set(binding.knob.candidates)
    elif binding.width is None:  # a head-dim literal
        values = {round_up(value, gen.for_head_dim)}
    else:  # a heads count: keep the width, choose heads so that width / heads is a multiple of the target
        width = binding.width.value
        heads = [h for h in range(width, 0, -1) if width % h == 0 and (width // h) % gen.for_head_dim == 0]
        return [h for h in heads if h != value][:MAX_HEAD_CHOICES]
    limit = value * (1 + gen.max_growth) if gen.max_growth is not None else None
    return sorted(v for v in values if v != value and v > 0 and (limit is None or v <= limit))


def _templates(pb: Playbook, env: dict[str, int], binding: _Binding | None,
               knobs: list[Knob] = ()) -> list[ActionTemplate] | None:
    out = []
    for spec in pb.actions:
        fixed = substitute(spec.fixed, env)
        choices: dict[str, list[Any]] = {}
        for name, choice in spec.choices.items():
            values = _generate(choice, binding, env) if isinstance(choice, Generator) else substitute(choice, env)
            values = list(dict.fromkeys(values))  # dedupe, keep order
            if not values:
                return None
            choices[name] = values
        tied = []
        if spec.kind == "pad_dim":
            fixed = {**fixed, **binding.knob.position()}
            tied = [m.position() for m in binding.knob.group_members(knobs)]
        out.append(ActionTemplate(kind=spec.kind, fixed=fixed, choices=choices, tied=tied))
    return out


def _drop_baseline_choices(templates: list[ActionTemplate], profile: Profile) -> list[ActionTemplate] | None:
    """A compile mode the baseline already ran is no change: leave it out of the search."""
    out = []
    for t in templates:
        if t.kind == "compile" and "mode" in t.choices:
            modes = [m for m in t.choices["mode"] if m != profile.mode_used]
            if not modes:
                return None
            t = t.model_copy(update={"choices": {**t.choices, "mode": modes}})
        if t.kind == "compile" and t.fixed.get("mode") == profile.mode_used:
            return None
        out.append(t)
    return out


def _first_sentence(text: str) -> str:
    text = " ".join(text.split())
    end = text.find(". ")
    return text if end < 0 else text[: end + 1]


def _match(pb: Playbook, profile: Profile, knobs: list[Knob], dot_share: float,
           dim_claims: dict[int, int]) -> tuple[list[Candidate], str]:
    found: list[Evidence] = []
    for cond in pb.applies_when:
        ok, ev = cond.evaluate(profile)
        if not ok:
            return [], f"does not apply: {cond.describe()} is false"
        found += ev
    env = variables(profile)
    dims = _select_dims(pb, profile) if pb.targets and pb.targets.dims else None
    if dims is not None and not dims:
        return [], "applies, but no unaligned dim of the padding report matches its targets"
    env["$dims"] = sorted(d.size for d in dims or [])
    common = dict(proposer=NAME, playbook=pb.id, tier=pb.rank.tier)

    if pb.targets and pb.targets.knobs:
        bindings = _bind_knobs(pb, dims, knobs)
        if not bindings:
            return [], "applies, but no knob sets the dims " + ", ".join(str(d.size) for d in dims)
        out = []
        for b in bindings:
            templates = _templates(pb, env, b, knobs)
            if templates is None:
                continue
            templates = _drop_baseline_choices(templates, profile)
            if templates is None:
                continue
            share = sum(d.share_of_padded_work / max(1, dim_claims.get(d.size, 1)) for d in b.dims)
            evidence = [_dim_evidence(d) for d in b.dims]
            via = f" through {b.width.name or b.width.id} = {b.width.value} / heads" if b.width else ""
            evidence.append(Evidence(what=f"knob {b.knob.label} sets it{via}", size=b.knob.value))
            new = templates[0].choices.get("new") if templates[0].kind == "pad_dim" else None
            title = f"{pb.title}: {b.knob.name or b.knob.id} {b.knob.value} -> {' or '.join(map(str, new or []))}"
            out.append(Candidate(
                id=f"{pb.id}@{b.knob.id}", title=title, actions=templates, evidence=evidence,
                score=round(share * dot_share * pb.rank.confidence, 6),
                preserves_numerics=numerics_preserved(templates),
                reason=f"{evidence[0].what}; {evidence[-1].what}. {_first_sentence(pb.rationale)}", **common,
            ))
        if not out:
            return [], ("applies, but no value to try for " + ", ".join(b.knob.name or b.knob.id for b in bindings)
                        + " (each equals the current one or exceeds the playbook's max_growth)")
        return out, f"applies: {len(out)} knob(s)"

    templates = _templates(pb, env, None)
    templates = _drop_baseline_choices(templates, profile) if templates is not None else None
    if templates is None:
        return [], "applies, but every value it would try is what the baseline already runs"
    evidence = found + [_dim_evidence(d) for d in dims or []]
    if pb.rank.gain == "total_waste":
        gain = METRICS["padding_waste"][1](profile) * dot_share
    elif pb.rank.gain == "dim_waste":
        gain = sum(d.share_of_padded_work for d in dims or []) * dot_share
    elif pb.rank.gain == "host_share":  # measured: what taking Python off the step could save at most
        gain = METRICS["host_share"][1](profile)
    elif pb.rank.gain == "compile_share":  # measured: the run's time spent compiling shapes again
        gain = profile.recompiling.compile_share if profile.recompiling else 0.0
    else:
        gain = pb.rank.value
    lead = evidence[0].what if evidence else "always applies"
    return [Candidate(
        id=pb.id, title=pb.title, actions=templates, evidence=evidence,
        score=round(gain * pb.rank.confidence, 6), preserves_numerics=numerics_preserved(templates),
        reason=f"{lead}. {_first_sentence(pb.rationale)}", **common,
    )], "applies"


def _merge(a: Candidate, b: Candidate) -> Candidate:
    """`b` proposes what `a` (the better ranked) changes: one candidate, the union of values and evidence."""
    templates = []
    for t in a.actions:
        twin = next((u for u in b.actions if u.target() == t.target() and u.fixed == t.fixed), None)
        if twin is not None:
            choices = {k: list(dict.fromkeys([*v, *twin.choices.get(k, [])])) for k, v in t.choices.items()}
            t = t.model_copy(update={"choices": choices})
        templates.append(t)
    seen = {e.what for e in a.evidence}
    evidence = [*a.evidence, *(e for e in b.evidence if e.what not in seen)]
    also = [*a.also_playbooks, *([b.playbook] if b.playbook else []), *b.also_playbooks]
    return a.model_copy(update={"actions": templates, "evidence": evidence, "also_playbooks": list(dict.fromkeys(also)),
                                "preserves_numerics": numerics_preserved(templates)})


def _order(c: Candidate):
    return (c.tier, -c.score, c.playbook or "", c.id)


def _was_tried(option, tried: list[frozenset[str]]) -> bool:
    """An option was measured when some trial's plan held all of its actions (alone or with others)."""
    keys = {action_key(a) for a in option}
    return any(keys <= t for t in tried)


def _without_tried(c: Candidate, tried: list[frozenset[str]]) -> Candidate | None:
    """Leave out values already tried; None when nothing new is left."""
    if not tried:
        return c
    if len(c.actions) == 1 and len(c.actions[0].choices) == 1:
        t = c.actions[0]
        (field, values), = t.choices.items()
        left = []
        for v in values:
            (option,) = t.model_copy(update={"choices": {field: [v]}}).expand_options()
            if not _was_tried(option, tried):
                left.append(v)
        if not left:
            return None
        return c.model_copy(update={"actions": [t.model_copy(update={"choices": {field: left}})]})
    return None if all(_was_tried(o, tried) for o in c.options()) else c


def propose_offline(profile: Profile, knobs: Sequence[Knob] = (), playbooks: Sequence[Playbook] | None = None,
                    results: Sequence[TrialOutcome] = (), round: int = 1) -> ProposalRound:
    """Rank the candidates the playbooks find in `profile`."""
    knob_refs = list(knobs)
    books = list(playbooks) if playbooks is not None else builtin_playbooks()
    dot_share = METRICS["dot_flop_share"][1](profile) or 1.0
    claims: dict[int, int] = {}
    if profile.padding:
        for d in profile.padding.dims:  # knobs that set the same size share its waste
            claims[d.size] = len({k.group or k.id for k in knob_refs if _sets(k, d.size) and not k.overridden}) or 1
    transcript: list[dict[str, Any]] = []
    candidates: list[Candidate] = []
    for pb in sorted(books, key=lambda p: p.id):
        found, why = _match(pb, profile, knob_refs, dot_share, claims)
        transcript.append({"playbook": pb.id, "applies": bool(found), "why": why, "candidates": [c.id for c in found]})
        candidates += found

    merged: dict[str, Candidate] = {}
    for c in sorted(candidates, key=_order):
        target = c.target()
        merged[target] = _merge(merged[target], c) if target in merged else c

    tried = [k for k in (r.action_keys() for r in results) if k]
    ranked = []
    for c in sorted(merged.values(), key=_order):
        kept = _without_tried(c, tried)
        if kept is None:
            transcript.append({"candidate": c.id, "dropped": "every option was tried in an earlier round"})
            continue
        ranked.append(kept.model_copy(update={"rank": len(ranked) + 1}))
    return ProposalRound(proposer=NAME, requested=NAME, round=round, candidates=ranked, transcript=transcript)


class OfflineProposer(Proposer):
    """The default proposer: deterministic, no key, no network."""

    name: ClassVar[str] = NAME

    def propose(self, profile: Profile, knobs: Sequence[Knob] = (), playbooks: Sequence[Playbook] | None = None,
                results: Sequence[TrialOutcome] = (), round: int = 1) -> ProposalRound:
        return propose_offline(profile, knobs, playbooks, results, round)
