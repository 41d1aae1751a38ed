"""What the Claude proposer shows the model and accepts from it: the tools over the run's data, the answer's schema.

The tools read the evidence (profile summary, hot ops, padding report, the
knobs with the finder's ranking and the source around them, playbooks, trial
results); `to_candidates` checks a `submit_proposals` answer against the
`Plan` action kinds and the discovered knobs, listing every problem with its
path (the text goes back to the model).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tpu_agent.plan.actions import ACTION_MODELS, ActionKind, Mesh
from tpu_agent.profilers.schema import Profile
from tpu_agent.propose.base import TrialOutcome
from tpu_agent.propose.candidates import ActionTemplate, Candidate, Evidence, numerics_preserved
from tpu_agent.propose.conditions import METRICS
from tpu_agent.propose.knobs import Knob
from tpu_agent.propose.offline import propose_offline
from tpu_agent.propose.playbook import Playbook

NAME = "claude"
MAX_TOOL_CHARS = 20_000
MAX_EXCERPT_CONTEXT = 15


# ------------------------------------------------------------------ what the model may answer


class ProposedAction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: ActionKind
    knob: str | None = Field(None, description="pad_dim only: the knob's id (file:line:column) or name")
    fixed: dict[str, Any] = Field(default_factory=dict)
    choices: dict[str, list[Any]] = Field(default_factory=dict)


class ProposedChange(BaseModel):
    model_config = ConfigDict(extra="forbid")

    title: str = Field(min_length=1, max_length=200)
    actions: list[ProposedAction] = Field(min_length=1, max_length=16)
    reason: str = Field(min_length=1, max_length=2000)
    playbook: str | None = None
    evidence: list[str] = Field(default_factory=list, max_length=10)


class Submission(BaseModel):
    model_config = ConfigDict(extra="forbid")

    proposals: list[ProposedChange] = Field(min_length=1, max_length=12)


class ProposalError(ValueError):
    """The model's answer broke the schema or the rules; the text goes back to the model."""


_ACTION_SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"type": "string", "enum": list(ActionKind.__args__)},
        "knob": {"type": "string", "description": "pad_dim only: a knob id from list_knobs (file:line:column) or its name"},
        "fixed": {"type": "object", "description": "fields with one value, e.g. {\"axes\": {\"data\": 2}}"},
        "choices": {"type": "object", "description": "field -> list of values for the search, e.g. {\"new\": [128, 256]}"},
    },
    "required": ["kind"],
    "additionalProperties": False,
}

SUBMIT_TOOL = {
    "name": "submit_proposals",
    "description": (
        "Submit your proposals, best first. Each proposal is one change to search: action templates over the "
        "plan action kinds with fixed fields and choices. Fields per kind: "
        + ", ".join(f"{kind} {cls.hint}" for kind, cls in ACTION_MODELS.items())
        + ". Sharding needs a mesh action in the same proposal. An invalid submission comes back with the error."
    ),
    "input_schema": {
        "type": "object",
        "properties": {
            "proposals": {
                "type": "array", "minItems": 1, "maxItems": 12,
                "items": {
                    "type": "object",
                    "properties": {
                        "title": {"type": "string"},
                        "actions": {"type": "array", "minItems": 1, "items": _ACTION_SCHEMA},
                        "reason": {"type": "string", "description": "why, citing the evidence"},
                        "playbook": {"type": "string", "description": "the playbook id it follows, if any"},
                        "evidence": {"type": "array", "items": {"type": "string"}},
                    },
                    "required": ["title", "actions", "reason"],
                    "additionalProperties": False,
                },
            },
        },
        "required": ["proposals"],
        "additionalProperties": False,
    },
}

_EMPTY = {"type": "object", "properties": {}, "additionalProperties": False}
TOOLS = [
    {"name": "profile_summary", "description": "The baseline profile in brief: step time, FLOPs, MFU, memory, "
     "mode, recompilations, padding waste, device.", "input_schema": _EMPTY},
    {"name": "hot_ops", "description": "The ops with the most FLOPs per step: shapes, share, aten op, source line.",
     "input_schema": {"type": "object", "properties": {"limit": {"type": "integer", "minimum": 1, "maximum": 50}},
                      "additionalProperties": False}},
    {"name": "padding_report", "description": "Estimated TPU tile-padding waste: unaligned dim sizes (worst first) "
     "with roles and FLOP-weighted waste, and the worst ops.", "input_schema": _EMPTY},
    {"name": "list_knobs", "description": "Integer literals of the script that set tensor dims: id, name, value, "
     "aligned values, the hot-op dims they match. pad_dim may only rewrite these.", "input_schema": _EMPTY},
    {"name": "source_excerpt", "description": "Source lines around a knob.",
     "input_schema": {"type": "object", "properties": {
         "knob": {"type": "string", "description": "knob id or name"},
         "context": {"type": "integer", "minimum": 0, "maximum": MAX_EXCERPT_CONTEXT}},
         "required": ["knob"], "additionalProperties": False}},
    {"name": "list_playbooks", "description": "The tuning playbooks: id, title, tier, whether each applies to this "
     "profile and why.", "input_schema": _EMPTY},
    {"name": "show_playbook", "description": "One playbook's YAML: conditions, actions, rationale, references.",
     "input_schema": {"type": "object", "properties": {"id": {"type": "string"}}, "required": ["id"],
                      "additionalProperties": False}},
    {"name": "trial_results", "description": "The trials measured so far: actions, status, speedup, step time, "
     "whether the loss held.", "input_schema": _EMPTY},
    SUBMIT_TOOL,
]

SYSTEM = """You are the tuning agent of tpu-agent. It profiled a PyTorch training script on a TPU device \
(or the bundled device that models one) and searches changes that TPUs reward; only changes whose speedup \
is measured and whose numerics are checked are kept.

Use the tools to read the evidence, then call submit_proposals with a few proposals, best first. Each is a \
change to search, made only of these action kinds: pad_dim (rewrite one knob, an integer literal of the \
script, listed by list_knobs), pad_ops (the backend zero-pads matmul operands: exact), mesh + shard_rule + \
batch_sharding (sharding over devices), compile (eager, fused or compiled step), matmul_precision. Give \
each field's candidate values in `choices`; the search tries them. Cite the evidence (op, dim, waste, time) \
in `reason`. Prefer changes the profile points at; after a round, learn from the trial results and do not \
repeat options already tried.

Your answer is data: it is validated against a schema and nothing you write is executed. Write no code."""


# ------------------------------------------------------------------ context the tools read


class _Context:
    def __init__(self, profile: Profile, knobs: list[Knob], playbooks: list[Playbook],
                 results: list[TrialOutcome], source_root: Path | None):
        self.profile, self.knobs, self.playbooks, self.results = profile, knobs, playbooks, results
        if source_root is None:  # knob files are relative to the script's directory
            guess = (Path(profile.cwd) / profile.script).parent
            source_root = guess if guess.is_dir() else None
        self.source_root = source_root
        self.offline = propose_offline(profile, knobs, playbooks, results)

    def knob(self, ref: str) -> Knob | None:
        return next((k for k in self.knobs if ref in (k.id, k.name)), None)


def _tool_profile_summary(ctx: _Context, _args) -> dict:
    p = ctx.profile
    return {
        "script": p.script, "args": p.args, "status": p.status, "mode_used": p.mode_used,
        "device": p.device.model_dump() if p.device else None,
        "steps": p.steps.stats.model_dump() if p.steps.stats else None,
        "compile_s": p.steps.compile_s, "compiles": p.steps.compiles,
        "flops": p.flops.model_dump(exclude={"check"}) if p.flops else None,
        "memory": p.memory.model_dump(),
        "executables": len(p.executables),
        **{name: fn(p) for name, (_, fn) in METRICS.items()},
        "recompilations": [r.model_dump() for r in p.recompilations[:10]],
        "transfers": p.transfers.model_dump() if p.transfers else None,
        "fallbacks": p.fallbacks, "notes": p.notes[:10],
    }


def _tool_hot_ops(ctx: _Context, args) -> list:
    limit = max(1, min(int(args.get("limit") or 10), 50))
    return [h.model_dump(include={"opcode", "shape", "operands", "flops_per_step", "share", "aten_op", "source"})
            for h in ctx.profile.hot_ops[:limit]]


def _tool_padding_report(ctx: _Context, _args) -> dict:
    pad = ctx.profile.padding
    if pad is None:
        return {"padding": None, "note": "the profile has no padding report"}
    ops = sorted(pad.ops, key=lambda o: -o.waste * o.flops_per_step)[:15]
    return {"generation": pad.generation, "mxu": pad.mxu, "estimate": True,
            "total_waste": pad.total_waste.value, "dims": [d.model_dump() for d in pad.dims],
            "worst_ops": [o.model_dump() for o in ops]}


def _tool_list_knobs(ctx: _Context, _args) -> list:
    """The knobs in the finder's ranking order, with what the ranking rests on (the profile's FLOP share)."""
    out = []
    for k in ctx.knobs:
        ranking = {"flop_share": k.flop_share, "matched_ops": k.matched_ops, "padding_waste": k.padding_waste,
                   "padded_to": k.padded_to}
        out.append({"id": k.id, "name": k.name, "value": k.value, "aligned": k.candidates, "batch": k.batch,
                    "uses": k.uses[:3], **({"derived": k.derived} if k.derived else {}),
                    **({"group": k.group} if k.group else {}), **({"overridden": k.overridden} if k.overridden else {}),
                    **({"sizes_modules": k.modules[:3]} if k.modules else {}),
                    **{key: v for key, v in ranking.items() if v}})
    return out


def _tool_source_excerpt(ctx: _Context, args) -> dict:
    knob = ctx.knob(str(args.get("knob", "")))
    if knob is None:
        raise ProposalError(f"unknown knob {args.get('knob')!r}; knobs: {', '.join(k.id for k in ctx.knobs) or 'none'}")
    if ctx.source_root is None:
        raise ProposalError("the source is not available in this run")
    root = ctx.source_root.resolve()
    path = (root / knob.file).resolve()
    if not path.is_relative_to(root) or not path.is_file():  # only the script's own files, never elsewhere
        raise ProposalError(f"{knob.file} is not readable here")
    context = max(0, min(int(args.get("context", 6)), MAX_EXCERPT_CONTEXT))
    lines = path.read_text(errors="replace").splitlines()
    lo, hi = max(1, knob.line - context), min(len(lines), knob.line + context)
    text = "\n".join(f"{'>' if n == knob.line else ' '}{n:5d}  {lines[n - 1]}" for n in range(lo, hi + 1))
    return {"file": knob.file, "knob": knob.id, "excerpt": text}


def _tool_list_playbooks(ctx: _Context, _args) -> list:
    why = {t["playbook"]: t for t in ctx.offline.transcript if "playbook" in t}
    return [{"id": pb.id, "title": pb.title, "tier": pb.rank.tier, "preserves_numerics": pb.preserves_numerics,
             "applies": why.get(pb.id, {}).get("applies"), "why": why.get(pb.id, {}).get("why")}
            for pb in ctx.playbooks]


def _tool_show_playbook(ctx: _Context, args) -> str:
    pb = next((p for p in ctx.playbooks if p.id == args.get("id")), None)
    if pb is None:
        raise ProposalError(f"unknown playbook {args.get('id')!r}; playbooks: {', '.join(p.id for p in ctx.playbooks)}")
    return pb.text()


def _shown_outcome(r: TrialOutcome) -> dict:
    """A trial as the model reads it: the outcome's unknown fields left out, each action whole (its nulls too)."""
    shown = r.model_dump(mode="json", exclude_none=True)
    shown["actions"] = [a.model_dump(mode="json") for a in r.actions]
    return shown


def _tool_trial_results(ctx: _Context, _args) -> list:
    return [_shown_outcome(r) for r in ctx.results]


_TOOL_FUNCS: dict[str, Callable[[_Context, dict], Any]] = {
    "profile_summary": _tool_profile_summary, "hot_ops": _tool_hot_ops, "padding_report": _tool_padding_report,
    "list_knobs": _tool_list_knobs, "source_excerpt": _tool_source_excerpt,
    "list_playbooks": _tool_list_playbooks, "show_playbook": _tool_show_playbook,
    "trial_results": _tool_trial_results,
}


def _run_tool(ctx: _Context, name: str, args: Any) -> tuple[str, bool]:
    """(text, is_error): tools read the run's data, nothing else."""
    if name not in _TOOL_FUNCS:
        return f"unknown tool {name!r}; tools: {', '.join(t['name'] for t in TOOLS)}", True
    try:
        out = _TOOL_FUNCS[name](ctx, args if isinstance(args, dict) else {})
    except ProposalError as exc:
        return str(exc), True
    text = out if isinstance(out, str) else json.dumps(out, default=str)
    if len(text) > MAX_TOOL_CHARS:
        text = text[:MAX_TOOL_CHARS] + f"... [cut at {MAX_TOOL_CHARS} characters]"
    return text, False


# ------------------------------------------------------------------ checking an answer


def _errors(exc: ValidationError, prefix: str = "") -> list[str]:
    out = []
    for err in exc.errors():
        loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"])
        out.append(f"{prefix}{loc}: {err['msg']}")
    return out


def to_candidates(data: Any, ctx: _Context, round: int) -> list[Candidate]:
    """Check a submit_proposals input; raise ProposalError listing every problem with its path."""
    try:
        sub = Submission.model_validate(data)
    except ValidationError as exc:
        raise ProposalError("; ".join(_errors(exc))) from None
    problems: list[str] = []
    candidates: list[Candidate] = []
    devices = METRICS["devices"][1](ctx.profile)
    book_ids = {pb.id for pb in ctx.playbooks}
    n = len(sub.proposals)
    for i, prop in enumerate(sub.proposals):
        where = f"proposals[{i}]"
        found: list[str] = []
        templates: list[ActionTemplate] = []
        if prop.playbook is not None and prop.playbook not in book_ids:
            found.append(f"{where}.playbook: unknown playbook {prop.playbook!r}")
        for j, act in enumerate(prop.actions):
            at = f"{where}.actions[{j}]"
            fixed = dict(act.fixed)
            if act.kind == "pad_dim":
                knob = ctx.knob(act.knob) if act.knob else None
                if knob is None:
                    found.append(f"{at}.knob: pad_dim must name a knob from list_knobs "
                                 f"({', '.join(k.id for k in ctx.knobs) or 'there are none'}), got {act.knob!r}")
                    continue
                extra = sorted((set(fixed) | set(act.choices)) - {"new"})
                if extra:  # the knob alone says which literal changes, never the model
                    found.append(f"{at}: pad_dim takes its file, line, column and old value from the knob; "
                                 f"set only `new` (got {', '.join(extra)})")
                    continue
                if knob.overridden:
                    found.append(f"{at}.knob: {knob.name or knob.id} is not the value in use ({knob.overridden}); "
                                 "rewriting it changes nothing")
                    continue
                fixed.update(knob.position())
                tied = [m.position() for m in knob.group_members(ctx.knobs)]
                sizes = act.choices.get("new", []) + ([fixed["new"]] if "new" in fixed else [])
                bad = [v for v in sizes if not isinstance(v, int) or isinstance(v, bool) or v == knob.value
                       or not 0 < v <= 16 * knob.value]
                if bad or not sizes:
                    found.append(f"{at}.choices.new: {', '.join(map(repr, bad)) if bad else 'nothing'} is not a new "
                                 f"size for {knob.name or knob.id} (integers other than {knob.value}, at most 16 times it)")
                    continue
            elif act.knob is not None:
                found.append(f"{at}.knob: only pad_dim names a knob")
                continue
            else:
                tied = []
            try:
                template = ActionTemplate(kind=act.kind, fixed=fixed, choices=act.choices, tied=tied)
                actions = template.expand()
            except ValidationError as exc:
                for err in exc.errors():
                    parts = [str(x) for x in err["loc"] if x != act.kind]
                    if parts and parts[0] in act.choices:
                        parts.insert(0, "choices")
                    elif parts and parts[0] in fixed:
                        parts.insert(0, "fixed")
                    found.append(".".join([at, *parts]) + f": {err['msg']}")
                continue
            except (ValueError, TypeError) as exc:
                found.append(f"{at}: {exc}")
                continue
            for a in actions:
                if isinstance(a, Mesh) and a.devices > devices:
                    found.append(f"{at}: a mesh of {a.axes} needs {a.devices} devices; the profile ran on {devices}")
                    break
            templates.append(template)
        if found:
            problems += found
            continue
        candidate = Candidate(
            id=f"claude-r{round}-{i + 1}", title=prop.title, proposer=NAME, playbook=prop.playbook,
            actions=templates, evidence=[Evidence(what=e[:400]) for e in prop.evidence], tier=1,
            score=round_score((n - i) / n), rank=i + 1, preserves_numerics=numerics_preserved(templates),
            reason=prop.reason,
        )
        try:
            if not candidate.options():
                problems.append(f"{where}: no option to try")
        except ValidationError as exc:
            problems += [f"{where}.actions (together): {m.split(': ', 1)[-1]}" for m in _errors(exc)]
        except ValueError as exc:
            problems.append(f"{where}.actions (together): {exc}")
        candidates.append(candidate)
    if problems:
        raise ProposalError("; ".join(problems))
    return candidates


def round_score(x: float) -> float:
    return round(x, 6)
