"""Knob discovery: the integer literals of a script that become tensor dims, and what to pad them to.

A static scan with libcst, no code run (knob_scan.py). A literal is a knob when it reaches a
size argument: directly (`nn.Linear(1023, 10)`), through a name
(`BATCH = 127` ... `torch.randn(BATCH, ...)`), an attribute (`args.batch_size`,
`cfg.d_model`), an argparse default or a parameter default, or through a call
to a function or class of the script whose parameter is a size
(`MLP(784, 1000)` with `nn.Linear(d_in, d_hidden)` inside), a dict spread
into one (`GPTConfig(**model_args)`), a dataclass field or a forwarded
`**kwargs` (config_flow.py). Names are matched by identifier, not by scope: a
cheap approximation that errs towards showing a knob; measurement decides
whether padding it pays. A default the script always overrides is listed as
overridden and never proposed.

With a baseline Profile the knobs are matched by value against the dims of
the hot ops (and of every dot/convolution in the padding report), and ranked
by the FLOP share of the ops they appear in; values already a multiple of
128 go last. Matching is by value: two knobs with the same value share
their matches.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, Field

from tpu_agent.plan.actions import PadDim
from tpu_agent.profilers.padding import round_up
from tpu_agent.propose import config_flow
from tpu_agent.propose.config_flow import Call
from tpu_agent.propose.expressions import elements, evaluate, identifiers
from tpu_agent.propose.knob_match import match_profile
from tpu_agent.propose.knob_scan import Def, Scan, Where, scan_files
from tpu_agent.propose.size_args import BATCH_NAME, Effect, effect_of

MULTIPLES = (8, 128, 256)  # sublane rows, lanes / v4-v5 MXU edge, v6e-v7 MXU edge
MAX_USES = 6


class Knob(BaseModel):
    """One integer literal that becomes a tensor dim, with the values worth trying."""

    file: str = Field(description="relative to the script's directory, as PadDim.file")
    line: int = Field(description="1-based")
    column: int = Field(description="0-based, in characters (libcst's, as PadDim.column)")
    value: int
    name: str | None = Field(None, description="the constant, parameter or option it sets; None: a bare literal")
    where: Where = Field(description="constant | argparse (a default) | parameter (a default) | literal (in a call)")
    uses: list[str] = Field(description="how it becomes a dim, e.g. 'nn.Linear(in_features) at odd_shapes.py:26'")
    candidates: list[int] = Field(description="next multiples of 8, 128 and 256 above the value, deduplicated")
    aligned_to: int = Field(description="the largest of 8/128/256 that divides the value (1: none)")
    derived: list[int] = Field(default_factory=list, description="other dims computed from it, e.g. 3 * D_MODEL")
    batch: bool = Field(False, description="it sets the batch size: compare speed per sample")
    effect: Effect = Field("model", description="what padding it changes: the architecture (model), the batch or "
                           "sequence length (training), or the shape of the user's data (data: never proposed)")
    effect_why: str = Field("", description="the use that decided its effect")
    overridden: str | None = Field(None, description="why its value is not the one used (set on the command line, "
                                   "by every call that builds the object, again later): never proposed")
    modules: list[str] = Field(default_factory=list, description="the modules the profile recorded built with its "
                               "value, e.g. 'Embedding(num_embeddings=50257, embedding_dim=64) x1: transformer.wte'")
    unused: str | None = Field(None, description="why it is never searched: with a profile that recorded the modules "
                               "built, a model dim whose value sizes no module and appears in no op")
    group: str | None = Field(None, description="bare literals of one value in one function or class body: "
                              "usually one dim written twice (Conv2d(3, 16) then BatchNorm2d(16)), so padded together")
    matched_ops: int = Field(0, description="hot ops of the profile with this value among their dims")
    flop_share: float | None = Field(None, description="their share of the step's FLOPs; None: no profile")
    padded_to: int | None = Field(None, description="the padding report's target size for this value (estimate)")
    padding_waste: float | None = Field(None, description="estimate: its share of the profile's padded dot/conv work")

    def pad_dim(self, new: int) -> PadDim:
        return PadDim(new=new, **self.position())

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}:{self.column}"

    @property
    def label(self) -> str:
        return f"{self.name} = {self.value} ({self.id})" if self.name else f"{self.value} at {self.id}"

    def position(self) -> dict:
        """The PadDim fields that say which literal to rewrite."""
        return {"file": self.file, "line": self.line, "column": self.column, "old": self.value, "name": self.name,
                "effect": self.effect, "batch": self.batch}

    def group_members(self, knobs: Sequence["Knob"]) -> list["Knob"]:
        """The other literals of its group (one dim written in several places)."""
        if self.group is None:
            return []
        return [k for k in knobs if k.group == self.group and k.id != self.id]


def pad_group(knobs: Sequence[Knob], knob: Knob, new: int) -> list[PadDim]:
    """PadDim actions for `knob` and every knob of its group (a named knob is a group of one)."""
    if knob.group is None:
        return [knob.pad_dim(new)]
    return [k.pad_dim(new) for k in knobs if k.group == knob.group]


class KnobReport(BaseModel):
    script: str
    files: list[str] = Field(description="the files scanned: the script and the local modules it imports")
    profile: str | None = Field(None, description="the profile matched against; None: static only")
    note: str = Field(description="where the ranking comes from, in one line")
    knobs: list[Knob]


def candidates_for(value: int) -> list[int]:
    """Next multiples of 8, 128 and 256 that are larger than `value`; never smaller, no repeats."""
    out = sorted({round_up(value, m) for m in MULTIPLES} - {value})
    return [c for c in out if c > value]


def aligned_to(value: int) -> int:
    return max((m for m in MULTIPLES if value % m == 0), default=1)


# ------------------------------------------------------------------ analysis (the scan: knob_scan.py)


@dataclass
class _Uses:
    uses: dict[str, list[str]] = field(default_factory=dict)  # identifier -> use descriptions
    derived: dict[str, set[int]] = field(default_factory=dict)
    batch: set[str] = field(default_factory=set)
    literals: dict[int, str] = field(default_factory=dict)  # id(Integer) -> its use
    roles: dict[str, dict[str, str]] = field(default_factory=dict)  # identifier -> role -> the first such use
    literal_roles: dict[int, dict[str, str]] = field(default_factory=dict)


def _analyse(scan: Scan, calls: Sequence[Call], unused: set[int]) -> _Uses:
    """What each identifier and literal sizes, through `calls` (the expanded ones); defs in `unused` (ids of
    overridden defaults) do not count as a name's value."""
    import libcst as cst

    result = _Uses()
    values: dict[str, set[int]] = {}
    for d in scan.defs:
        if id(d) not in unused:
            values.setdefault(d.ident, set()).add(d.value)
    constants = {k: next(iter(v)) for k, v in values.items() if len(v) == 1}
    literal_ids = result.literals

    def record(expr, use: str, where: str, literal_ok: bool = True, roles: dict[str, str] | None = None) -> bool:
        grew = False
        batch_use = "batch_size" in use
        for element in elements(expr):
            if isinstance(element, cst.Integer):
                # A route through the script's callables says more than a bare keyword (`build(d_model=)`).
                if literal_ok and (id(element) not in literal_ids or
                                   " -> " in use and " -> " not in literal_ids[id(element)]):
                    literal_ids[id(element)] = f"{use} at {where}"
                    grew = True
                if literal_ok:
                    for role, text in roles.items():
                        result.literal_roles.setdefault(id(element), {}).setdefault(role, text)
                continue
            idents = identifiers(element)
            value = None if isinstance(element, (cst.Name, cst.Attribute)) else evaluate(element, constants)
            for ident in idents:
                uses = result.uses.setdefault(ident, [])
                text = f"{use} at {where}"
                if text not in uses:
                    uses.append(text)
                    grew = True
                if value is not None and value >= 2:
                    result.derived.setdefault(ident, set()).add(value)
                if batch_use:
                    result.batch.add(ident)
                for role, text in roles.items():
                    grew |= role not in result.roles.setdefault(ident, {})
                    result.roles[ident].setdefault(role, text)
        return grew

    for expr, use, where, literal_ok, role in scan.sites:
        record(expr, use, where, literal_ok, {role: f"{use} at {where}"})

    # Calls to the script's own functions and classes: an argument is a dim when its parameter is one.
    for _ in range(6):
        grew = False
        for call in calls:
            params = scan.params.get(call.callee)
            if not params:
                continue
            for index, (kw, expr, via) in enumerate(call.args):
                param = kw if kw is not None else (params[index] if index < len(params) else None)
                if param is None or param not in params or param not in result.uses:
                    continue
                first = result.uses[param][0].split(" at ")[0]
                grew |= record(expr, f"{via}{call.callee}({param}) -> {first}", call.where,
                               roles=dict(result.roles.get(param, {})))
        if not grew:
            break
    return result


def _overridden(d: Def, scan: Scan, calls: Sequence[Call], script_args: Sequence[str]) -> str | None:
    """Why the value at `d` is not the one the run uses; None: it may be."""
    if d.options:
        return config_flow.overridden_command_line(d.options, script_args)
    if d.where == "parameter":
        return config_flow.overridden_default(d.owner, d.ident, calls, scan.params)
    configs = {f: {name: lines[-1] for (g, name), lines in scan.flow.top.items() if g == f} for f in scan.config_files}
    return config_flow.overridden_global(d.file, d.ident, d.line, scan.flow, script_args, configs)


def discover(script: Path | str, *, profile=None, script_args: Sequence[str] = (), profile_path: str | None = None,
             note: str | None = None) -> KnobReport:
    """Scan `script` (and the local modules it imports) for knobs; rank them by a Profile when given."""
    script = Path(script)
    scan = scan_files(script, script_args)
    calls = config_flow.expand(scan.calls, scan.flow, scan.params, [d.ident for d in scan.defs if d.options])
    scan.sites[:0] = config_flow.spread_sites(calls, scan.params)  # first: the route says more than a keyword
    overridden = {id(d): why for d in scan.defs if (why := _overridden(d, scan, calls, script_args))}
    uses = _analyse(scan, calls, set(overridden))
    knobs: dict[tuple[str, int, int], Knob] = {}
    sizing: set[str] = set()  # knobs that size a module or tensor directly (not only through view/reshape)
    for d in scan.defs:
        if d.ident not in uses.uses:
            continue
        knob = Knob(
            file=d.file, line=d.line, column=d.column, value=d.value, name=d.name, where=d.where,
            uses=uses.uses[d.ident][:MAX_USES], candidates=candidates_for(d.value), aligned_to=aligned_to(d.value),
            derived=sorted(uses.derived.get(d.ident, set()) - {d.value}) if id(d) not in overridden else [],
            batch=bool(BATCH_NAME.search(d.ident)) or d.ident in uses.batch,
            overridden=overridden.get(id(d)),
        )
        knob.effect, knob.effect_why = effect_of(d.ident, knob.batch, uses.roles.get(d.ident, {}))
        knobs.setdefault((d.file, d.line, d.column), knob)
        sizing |= {knob.id} if "model" in uses.roles.get(d.ident, {}) else set()
    for node_id, use in uses.literals.items():
        if node_id not in scan.positions:
            continue  # a literal below 2 (a 1 in view(-1, 1)): nothing to pad
        file, line, column, value, scope = scan.positions[node_id]
        # GPT2Config(vocab_size=50257), cfg['vocab_size'] = 50257: named by its keyword
        keyword = re.match(r"[\w.]+\((\w+)=\) at |\w+\['(\w+)'\] -> ", use)
        knob = Knob(file=file, line=line, column=column, value=value,
                    name=(keyword.group(1) or keyword.group(2)) if keyword else None,
                    where="literal", uses=[use],
                    group=f"{file}:{scope}:{value}", candidates=candidates_for(value), aligned_to=aligned_to(value),
                    batch="batch_size" in use)
        knob.effect, knob.effect_why = effect_of(None, knob.batch, uses.literal_roles.get(node_id, {}))
        knobs.setdefault((file, line, column), knob)
        sizing |= {knob.id} if "model" in uses.literal_roles.get(node_id, {}) else set()
    found = list(knobs.values())
    if profile is not None:
        match_profile(found, profile, sizing)
    order = {f: i for i, f in enumerate(scan.files)}

    def rank(k: Knob):
        share = k.flop_share or 0.0
        unused = k.overridden is not None or k.unused is not None
        return (unused, not k.candidates, k.aligned_to >= 128, -share, -(k.padding_waste or 0.0),
                order.get(k.file, 0), k.line, k.column)

    found.sort(key=rank)
    if note is None:
        note = (f"ranked by the FLOP share of the profile's hot ops whose dims they match ({profile_path}); "
                "values already a multiple of 128 last"
                if profile is not None else "static only: no profile, so not ranked by hot ops; values already a "
                "multiple of 128 last")
    return KnobReport(script=str(script), files=scan.files, profile=profile_path if profile is not None else None,
                      note=note, knobs=found)
