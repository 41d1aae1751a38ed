"""Playbooks: tuning knowledge as YAML data (one playbook per file), validated when loaded.

Built-ins ship as package data of `tpu_agent.playbooks` (the top-level
`playbooks/` folder). Users add theirs with `--playbooks DIR` or
`[tool.tpu-agent] playbooks = "DIR"` (or a list) in their pyproject.toml; a
user playbook with a built-in's id replaces it.

This module is `playbook.py`, not `playbooks.py`: `tpu_agent.playbooks` is
the data package, and a module of the same name would be shadowed by it in
an installed wheel.

A playbook says when it applies (`applies_when`: conditions over profile
fields or named metrics), what it targets (unaligned dims of the padding
report and the source knobs that set them), which actions to try with which
values (`actions`: templates over the `Plan` action kinds, nothing else),
how to rank what it finds (`rank`), and why (`rationale`, `references`).
Every problem is reported as `FILE: FIELD: PROBLEM`.
"""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tpu_agent.errors import InputError
from tpu_agent.config import find_pyproject, folders
from tpu_agent.plan.actions import ACTION_KINDS, ACTION_MODELS
from tpu_agent.propose.candidates import ActionTemplate
from tpu_agent.propose.conditions import (  # noqa: F401 - re-exported: what playbooks may name
    METRICS,
    VARIABLES,
    Condition,
    _sample_variables,
    check_field_path,
    name_words,
    resolve_field,
    substitute,
    variables,
    _walk,
)

BUILTIN_PACKAGE = "tpu_agent.playbooks"
PAD_DIM_BOUND = ("file", "line", "column", "old", "name", "effect", "batch")  # from the knob, never in a playbook


class PlaybookError(InputError):
    """A playbook file is invalid (exit 2): names the file, the field and the problem."""

    def __init__(self, file: str | Path, field: str, problem: str):
        self.file, self.field, self.problem = str(file), field, problem
        super().__init__(f"{file}: {field}: {problem}" if field else f"{file}: {problem}")


Role = Literal["M", "K", "N"]


class DimSelect(BaseModel):
    """Unaligned dims of the padding report this playbook is about."""

    model_config = ConfigDict(extra="forbid")

    roles_any: list[Role] | None = Field(None, description="keep dims with at least one of these roles")
    min_share: float = Field(0.0, ge=0, le=1, description="estimate: least share of the padded dot/conv work")
    min_size: int = Field(1, ge=1)
    max_growth: float | None = Field(None, gt=0, description="keep dims that padding grows by at most this fraction "
                                     "(a vocabulary of 50257 padded to 50304: 0.1 %)")


class KnobSelect(BaseModel):
    """Source knobs that set those dims: one candidate per knob found."""

    model_config = ConfigDict(extra="forbid")

    match: Literal["dim", "head_dim"] = Field(
        "dim", description="dim: the knob's value is a selected dim; head_dim: a heads-count knob whose width "
        "knob / heads is a selected dim, or a head-dim knob equal to one")
    name_words: list[str] | None = Field(None, description="keep knobs with a name word starting with one of these "
                                         "(words: the name split at _, digits and camelCase; case-insensitive)")
    not_name_words: list[str] | None = Field(None, description="drop knobs with a name word starting with one of these")
    name_regex: str | None = Field(None, description="keep knobs whose name matches (case-insensitive search)")
    name_not_regex: str | None = Field(None, description="drop knobs whose name matches (case-insensitive search)")
    batch: bool | None = Field(None, description="true: batch-size knobs only; false: no batch-size knobs "
                               "(the knob finder's flag, else the name)")

    def keeps(self, name: str | None, batch: bool = False) -> bool:
        """Whether a knob passes the filters (a knob without a name passes only when no name filter is set)."""
        if self.batch is not None and batch != self.batch:
            return False
        words = name_words(name or "")
        if self.name_words is not None and not any(w.startswith(p.lower()) for w in words for p in self.name_words):
            return False
        if self.not_name_words and any(w.startswith(p.lower()) for w in words for p in self.not_name_words):
            return False
        if self.name_regex is not None and not (name and re.search(self.name_regex, name, re.I)):
            return False
        if self.name_not_regex is not None and name and re.search(self.name_not_regex, name, re.I):
            return False
        return True

    @field_validator("name_regex", "name_not_regex")
    @classmethod
    def _compiles(cls, value):
        if value is not None:
            try:
                re.compile(value)
            except re.error as exc:
                raise ValueError(f"not a regular expression: {exc}") from None
        return value


class Targets(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dims: DimSelect | None = None
    knobs: KnobSelect | None = None

    @model_validator(mode="after")
    def _knobs_need_dims(self):
        if self.knobs is not None and self.dims is None:
            raise ValueError("knobs are matched against dims: set targets.dims too")
        return self


class Generator(BaseModel):
    """Values computed from the bound knob (pad_dim `new` only)."""

    model_config = ConfigDict(extra="forbid")

    round_up_to: list[int | str] | None = Field(None, description="the knob's value rounded up to each multiple")
    for_head_dim: int | None = Field(None, ge=1, description="heads counts giving this head dim (or a head dim rounded up to it)")
    knob_aligned: bool | None = Field(None, description="the aligned values the knob finder suggested")
    max_growth: float | None = Field(None, gt=0, description="drop values more than this fraction above the "
                                     "knob's (0.25: at most 25% larger)")

    @model_validator(mode="after")
    def _one(self):
        if sum(v is not None for v in (self.round_up_to, self.for_head_dim, self.knob_aligned)) != 1:
            raise ValueError("a generator is exactly one of round_up_to, for_head_dim, knob_aligned")
        return self


class ActionSpec(BaseModel):
    """An action template in a playbook: `fixed` fields and `choices` (a list, or a generator) to search."""

    model_config = ConfigDict(extra="forbid")

    kind: str
    fixed: dict[str, Any] = Field(default_factory=dict)
    choices: dict[str, list[Any] | Generator | str] = Field(default_factory=dict, description=(
        "per field: a list of values, a generator, or a $variable whose value is the list"))

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, kind):
        if kind not in ACTION_KINDS:
            raise ValueError(f"unknown action kind {kind!r} (known: {', '.join(ACTION_KINDS)})")
        return kind

    @field_validator("choices", mode="before")
    @classmethod
    def _choice_shapes(cls, choices):
        if not isinstance(choices, dict):
            return choices
        for name, value in choices.items():
            if isinstance(value, str) and value.startswith("$"):
                continue  # a variable holding the list (checked against the known ones with the rest)
            if not isinstance(value, (list, dict)):
                raise ValueError(f"choices.{name} must be a list of values or a generator "
                                 "({round_up_to: [...]}, {for_head_dim: N} or {knob_aligned: true}), "
                                 f"not {value!r}")
            if isinstance(value, list) and not value:
                raise ValueError(f"choices.{name} is empty")
        return choices


class Rank(BaseModel):
    """How the offline proposer ranks what the playbook finds: by tier, then by score."""

    model_config = ConfigDict(extra="forbid")

    tier: int = Field(2, ge=1, le=3, description="1: the padding report or a measured bottleneck points at it; "
                      "2: other profile evidence; 3: generic")
    gain: Literal["dim_waste", "total_waste", "host_share", "compile_share", "fixed"] = Field(
        "fixed", description="dim_waste: the matched dims' share of padded work; total_waste: the report's total; "
        "host_share: the measured host share of the step (host_device); compile_share: the measured share of the "
        "run spent compiling again (recompiling); fixed: `value` (an assumed share of the step)")
    value: float = Field(0.0, ge=0, le=1)
    confidence: float = Field(0.5, gt=0, le=1, description="how much of the estimated gain a trial tends to keep")


class Playbook(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(pattern=r"^[a-z0-9][a-z0-9-]*$")
    title: str = Field(min_length=1)
    applies_when: list[Condition] = Field(default_factory=list, description="all must hold; empty: always")
    targets: Targets | None = None
    actions: list[ActionSpec] = Field(min_length=1)
    preserves_numerics: bool
    rationale: str = Field(min_length=1)
    references: list[str] = Field(default_factory=list)
    rank: Rank = Field(default_factory=Rank)
    source: str | None = Field(None, exclude=True, description="the file it was loaded from")

    @property
    def builtin(self) -> bool:
        return bool(self.source) and self.source.startswith("builtin:")

    def text(self) -> str:
        """The YAML as written (built-ins from the package)."""
        if self.source is None:
            return yaml.safe_dump(self.model_dump(mode="json", by_alias=True, exclude_none=True), sort_keys=False)
        if self.builtin:
            return resources.files(BUILTIN_PACKAGE).joinpath(self.source.split(":", 1)[1]).read_text()
        return Path(self.source).read_text()


def check_playbook(pb: Playbook) -> list[tuple[str, str]]:
    """Problems the schema alone cannot see, as (field, problem)."""
    problems: list[tuple[str, str]] = []
    knobs = pb.targets.knobs if pb.targets else None
    sample = _sample_variables()
    templates = []
    for i, spec in enumerate(pb.actions):
        where = f"actions[{i}]"
        before = len(problems)
        model = ACTION_MODELS[spec.kind]
        allowed = set(model.model_fields) - {"kind", "effect"}  # an action's class is the tool's to say
        for part in ("fixed", "choices"):
            for name in getattr(spec, part):
                if name not in allowed:
                    problems.append((f"{where}.{part}.{name}", f"{spec.kind} has no field {name!r} "
                                     f"(fields: {', '.join(sorted(allowed))})"))
                elif spec.kind == "pad_dim" and name in PAD_DIM_BOUND:
                    problems.append((f"{where}.{part}.{name}", "pad_dim takes file, line, column, old and name "
                                     "from the matched knob; set only `new`"))
                elif name in spec.fixed and name in spec.choices:
                    problems.append((f"{where}.{part}.{name}", "set in both fixed and choices"))
        for value in _walk([spec.fixed, [c for c in spec.choices.values() if isinstance(c, (list, str))],
                            [c.round_up_to for c in spec.choices.values() if isinstance(c, Generator)]]):
            if isinstance(value, str) and value.startswith("$") and value not in VARIABLES:
                problems.append((where, f"unknown variable {value!r} (known: {', '.join(VARIABLES)})"))
        for name, choice in spec.choices.items():
            if isinstance(choice, Generator):
                if spec.kind != "pad_dim" or name != "new":
                    problems.append((f"{where}.choices.{name}", "generators compute pad_dim `new` values only"))
                elif knobs is None:
                    problems.append((f"{where}.choices.{name}", "a generator needs targets.knobs to bind a knob"))
                elif choice.for_head_dim is not None and knobs.match != "head_dim":
                    problems.append((f"{where}.choices.{name}", "for_head_dim needs targets.knobs.match: head_dim"))
        if spec.kind == "pad_dim":
            if knobs is None:
                problems.append((where, "pad_dim rewrites a source knob: set targets.knobs"))
            if "new" not in spec.choices and "new" not in spec.fixed:
                problems.append((where, "pad_dim needs `new` (in choices)"))
        if len(problems) > before:
            continue
        # Check the values with the plan models, on sample variables and a sample knob.
        fixed = substitute(spec.fixed, sample)
        choices = {}
        for name, choice in spec.choices.items():
            choices[name] = [256] if isinstance(choice, Generator) else substitute(choice, sample)
        if spec.kind == "pad_dim":
            fixed = {**fixed, "file": "train.py", "line": 1, "column": 0, "old": 255}
        try:
            template = ActionTemplate(kind=spec.kind, fixed=fixed, choices=choices)
            template.expand()
            templates.append(template)
        except ValidationError as exc:
            for err in exc.errors():
                parts = [str(x) for x in err["loc"] if x != spec.kind]
                if parts and parts[0] in spec.choices:
                    parts.insert(0, "choices")
                elif parts and parts[0] in spec.fixed:
                    parts.insert(0, "fixed")
                problems.append((".".join([where, *parts]), err["msg"]))
        except (ValueError, TypeError) as exc:
            problems.append((where, str(exc)))
    if not problems and len(templates) == len(pb.actions):
        changes = sorted({a.kind for t in templates for a in t.expand() if not a.preserves_numerics})
        if pb.preserves_numerics and changes:
            problems.append(("preserves_numerics", f"is true, but {', '.join(changes)} can change the losses"))
        if not pb.preserves_numerics and not changes:
            problems.append(("preserves_numerics", "is false, but every action preserves numerics"))
    if pb.rank.gain in ("dim_waste", "total_waste") and (pb.targets is None or pb.targets.dims is None):
        problems.append(("rank.gain", f"{pb.rank.gain} needs targets.dims (the padding report)"))
    return problems


# ------------------------------------------------------------------ loading


def _loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif str(part).startswith(("list[", "Generator", "function-")):
            continue
        else:
            out += ("." if out else "") + str(part)
    return out or "(top level)"


def parse_playbook(data: Any, source: str) -> Playbook:
    """Validate one playbook's data; raise PlaybookError naming the source, the field and the problem."""
    if not isinstance(data, dict):
        raise PlaybookError(source, "(top level)", f"a playbook is a YAML mapping, not {type(data).__name__}")
    try:
        pb = Playbook.model_validate({**data, "source": None})
    except ValidationError as exc:
        problems = []
        errors = exc.errors()
        # choices.X is a list or a generator: when a generator (a mapping) was given, the list branch's
        # "should be a valid list" is noise beside the generator's own error.
        def branch(loc) -> int | None:
            return next((i for i, p in enumerate(loc) if isinstance(p, str) and "Generator" in p), None)

        generator_locs = {e["loc"][:branch(e["loc"])] for e in errors if branch(e["loc"]) is not None}
        errors = [e for e in errors if not (e["type"] == "list_type" and e["loc"][:-1] in generator_locs)]
        for err in errors:
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                msg = "unknown field"
            problems.append((_loc(err["loc"]), msg))
        field, problem = problems[0]
        more = f" (and {len(problems) - 1} more: " + "; ".join(f"{f}: {p}" for f, p in problems[1:]) + ")" if len(problems) > 1 else ""
        raise PlaybookError(source, field, problem + more) from None
    problems = check_playbook(pb)
    if problems:
        field, problem = problems[0]
        more = f" (and {len(problems) - 1} more: " + "; ".join(f"{f}: {p}" for f, p in problems[1:]) + ")" if len(problems) > 1 else ""
        raise PlaybookError(source, field, problem + more)
    return pb.model_copy(update={"source": source})


def _read_yaml(text: str, source: str):
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark else "(top level)"
        raise PlaybookError(source, where, f"not valid YAML: {getattr(exc, 'problem', None) or exc}") from None


def load_file(path: str | Path) -> Playbook:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise PlaybookError(path, "", f"cannot read: {exc.strerror or exc}") from None
    return parse_playbook(_read_yaml(text, str(path)), str(path))


def _yaml_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file())


def load_dir(directory: str | Path) -> list[Playbook]:
    """Every *.yaml / *.yml in `directory` (not recursive); ids must be unique."""
    directory = Path(directory)
    if not directory.is_dir():
        raise PlaybookError(directory, "", "not a directory of playbooks")
    out = [load_file(p) for p in _yaml_files(directory)]
    _unique(out)
    return out


def load_path(path: str | Path) -> list[Playbook]:
    """A playbook file or a directory of them."""
    path = Path(path)
    if not path.exists():
        raise PlaybookError(path, "", "no such file or directory")
    return load_dir(path) if path.is_dir() else [load_file(path)]


def _unique(playbooks: list[Playbook]) -> None:
    seen: dict[str, Playbook] = {}
    for pb in playbooks:
        if pb.id in seen:
            raise PlaybookError(pb.source, "id", f"{pb.id!r} is already defined in {seen[pb.id].source}")
        seen[pb.id] = pb


def builtin_playbooks() -> list[Playbook]:
    root = resources.files(BUILTIN_PACKAGE)
    out = []
    for entry in sorted(root.iterdir(), key=lambda e: e.name):
        if entry.name.endswith((".yaml", ".yml")):
            source = f"builtin:{entry.name}"
            out.append(parse_playbook(_read_yaml(entry.read_text(), source), source))
    _unique(out)
    return out


def project_playbook_dirs(start: str | Path | None = None) -> list[Path]:
    """`playbooks` of the nearest pyproject.toml at or above `start` (default: cwd) with a [tool.tpu-agent]
    table (config's reader, as tune's options read it); paths are relative to that pyproject.toml."""
    found = find_pyproject(Path(start or Path.cwd()))
    if found is None or found[1].get("playbooks") is None:
        return []
    path, table = found
    try:
        return [Path(d) for d in folders(table["playbooks"], path.parent)]
    except ValueError as exc:
        raise PlaybookError(path, "tool.tpu-agent.playbooks", str(exc)) from None


def load_playbooks(dirs: list[str | Path] | tuple = (), *, project_dir: str | Path | None = None,
                   builtin: bool = True) -> list[Playbook]:
    """Built-ins, then the project's (the pyproject.toml above `project_dir`, when given), then `dirs`;
    a later id replaces an earlier one, and a folder named twice loads once."""
    layers = [builtin_playbooks()] if builtin else []
    project = project_playbook_dirs(project_dir) if project_dir is not None else []
    for directory in dict.fromkeys(p.resolve() for p in [*project, *map(Path, dirs)]):
        layers.append(load_path(directory))
    merged: dict[str, Playbook] = {}
    for layer in layers:
        for pb in layer:
            merged[pb.id] = pb
    return sorted(merged.values(), key=lambda pb: (pb.rank.tier, pb.id))
