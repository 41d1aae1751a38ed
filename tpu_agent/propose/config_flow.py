"""Knobs followed through configs: dicts, `**kwargs`, dataclass fields, and the defaults a script overrides.

The knob finder (knobs.py) matches names by identifier. This module adds the
routes that names alone miss, statically (libcst, nothing runs):

- a dict (`{"k": v}`, `dict(k=v)`, `d["k"] = v`, `d.update(k=v)`) spread into
  a call (`GPTConfig(**model_args)`) passes each entry as a keyword;
  `**vars(args)` passes every argparse option;
- a function that forwards its `**kwargs` (`def make(**kw): return GPT(**kw)`)
  passes its callers' extra keywords on;
- a dataclass (or pydantic model, NamedTuple) takes its annotated fields as
  parameters, in order, with their defaults;
- a default is overridden, so padding it changes nothing, when every call
  that builds the object sets that parameter, when a later module-level
  assignment sets the global again, or, in a nanoGPT-style script
  (`exec(open("configurator.py").read())`), when `--name=value` or a config
  file given on the command line sets it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tpu_agent.propose.expressions import identifiers
from tpu_agent.propose.size_args import DIM_KEYWORDS, KEYWORD_ROLES, MODULE_DIMS

RECORD_BASES = {"BaseModel", "NamedTuple", "TypedDict"}
MAX_DEPTH = 4  # forwarding through at most this many **kwargs functions


@dataclass
class Call:
    """A call in the script: to one of its own callables, or (when it spreads a dict) to anything."""

    callee: str
    method: bool
    args: list[tuple[str | None, object, str]]  # (keyword or None, expression, route so far: "d['k'] -> ")
    where: str
    spread: list[object] = field(default_factory=list)  # `**expr` not resolved to keywords
    starred: bool = False  # a `*args`: which positional parameters it sets is unknown
    scope: str | None = None  # the callable it is made in (a class for its __init__)
    also_sets: frozenset[str] = frozenset()  # forwarded: what the forwarding call sets itself
    forwards: bool = False  # it passes its scope's own **kwargs on
    shown: str = ""  # how a report names it: GPTConfig(**model_args)
    written: int | None = None  # args written at the call; the rest came through a spread or forwarding


@dataclass
class Flow:
    """What the config-following routes need from the scanned files."""

    dicts: dict[str, list[tuple[str, object]]] = field(default_factory=dict)  # name -> its (literal key, value)
    fields: dict[str, list[str]] = field(default_factory=dict)  # dataclass-like class -> its fields, in order
    kwargs: dict[str, str] = field(default_factory=dict)  # callable -> the name of its **kwargs parameter
    top: dict[tuple[str, str], list[int]] = field(default_factory=dict)  # (file, global) -> lines assigning it
    configurator: tuple[str, int] | None = None  # (file, line) of exec(open(...).read()) at module level


def _name(node) -> str:
    from libcst.helpers import get_full_name_for_node

    return get_full_name_for_node(node) or ""


def _key(node) -> str | None:
    import libcst as cst

    if isinstance(node, cst.SimpleString) and isinstance(node.evaluated_value, str):
        return node.evaluated_value
    return None


def _record_class(node) -> bool:
    """A class whose annotated fields are its constructor's parameters: @dataclass, pydantic, NamedTuple."""
    decorators = [_name(getattr(d.decorator, "func", d.decorator)) for d in node.decorators]  # @dataclass(...) too
    return (any(n.rsplit(".", 1)[-1] == "dataclass" for n in decorators)
            or any(_name(b.value).rsplit(".", 1)[-1] in RECORD_BASES for b in node.bases))


def collector(flow: Flow, rel: str):
    """A libcst visitor that feeds `flow` from one file (run through a MetadataWrapper)."""
    import libcst as cst
    from libcst.metadata import PositionProvider

    class Visitor(cst.CSTVisitor):
        METADATA_DEPENDENCIES = (PositionProvider,)

        def line(self, node) -> int:
            return self.get_metadata(PositionProvider, node).start.line

        def entry(self, target: str, key: str | None, value) -> None:
            if key is not None:
                flow.dicts.setdefault(target, []).append((key, value))

        def entries(self, target: str, value) -> None:
            """`target = {...}` or `dict(...)`: its literal keys (a `**other` merges other's)."""
            if isinstance(value, cst.Dict):
                for el in value.elements:
                    if isinstance(el, cst.DictElement):
                        self.entry(target, _key(el.key), el.value)
                    elif isinstance(el.value, cst.Name):
                        flow.dicts.setdefault(target, []).extend(flow.dicts.get(el.value.value, []))
            elif isinstance(value, cst.Call) and _name(value.func) == "dict":
                for arg in value.args:
                    if arg.keyword is not None:
                        self.entry(target, arg.keyword.value, arg.value)
                    elif isinstance(arg.value, (cst.Dict, cst.Call)):
                        self.entries(target, arg.value)
                    elif isinstance(arg.value, cst.Name):
                        flow.dicts.setdefault(target, []).extend(flow.dicts.get(arg.value.value, []))

        def visit_Module(self, node):
            for stmt in node.body:  # module-level, unconditional: what a later one overrides
                for small in getattr(stmt, "body", ()) if isinstance(stmt, cst.SimpleStatementLine) else ():
                    targets = ([t.target for t in small.targets] if isinstance(small, cst.Assign)
                               else [small.target] if isinstance(small, cst.AnnAssign) else [])
                    value = small.value if targets else None
                    for t in targets:  # `x = x * 2` builds on the value before: not an override
                        if isinstance(t, cst.Name) and value is not None and t.value not in identifiers(value):
                            flow.top.setdefault((rel, t.value), []).append(self.line(value))
                    call = small.value if isinstance(small, cst.Expr) else None
                    if (isinstance(call, cst.Call) and _name(call.func) == "exec"
                            and "open" in cst.Module([]).code_for_node(call)):
                        flow.configurator = flow.configurator or (rel, self.line(small))

        def visit_ClassDef(self, node):
            if _record_class(node):
                names = [s.target.value for line in node.body.body if isinstance(line, cst.SimpleStatementLine)
                         for s in line.body if isinstance(s, cst.AnnAssign) and isinstance(s.target, cst.Name)
                         and "ClassVar" not in cst.Module([]).code_for_node(s.annotation.annotation)]
                flow.fields.setdefault(node.name.value, names)

        def visit_FunctionDef(self, node):
            star = node.params.star_kwarg
            if star is not None:
                flow.kwargs.setdefault(node.name.value, star.name.value)

        def visit_Assign(self, node):
            for t in node.targets:
                target = t.target
                if isinstance(target, cst.Name):
                    self.entries(target.value, node.value)
                elif (isinstance(target, cst.Subscript) and isinstance(target.value, cst.Name)
                      and len(target.slice) == 1 and isinstance(target.slice[0].slice, cst.Index)):
                    self.entry(target.value.value, _key(target.slice[0].slice.value), node.value)

        def visit_Call(self, node):
            func = node.func
            if isinstance(func, cst.Attribute) and func.attr.value == "update" and isinstance(func.value, cst.Name):
                self.entries(func.value.value, cst.Call(func=cst.Name("dict"), args=node.args))

    return Visitor()


def callable_key(scopes: Sequence[tuple[str, str]]) -> str | None:
    """The name calls use for the innermost callable: its class for an __init__."""
    for i in range(len(scopes) - 1, -1, -1):
        kind, name = scopes[i]
        if kind == "def":
            return scopes[i - 1][1] if name == "__init__" and i and scopes[i - 1][0] == "class" else name
    return None


# ------------------------------------------------------------------ calls as they reach their callees


def _spread_entries(expr, flow: Flow, options: Sequence[str]) -> list[tuple[str, object, str]] | None:
    """The (keyword, value, route) a `**expr` passes; None when unknown."""
    import libcst as cst

    if isinstance(expr, cst.Name) and expr.value in flow.dicts:
        return [(k, v, f"{expr.value}['{k}'] -> ") for k, v in flow.dicts[expr.value]]
    if isinstance(expr, cst.Call) and _name(expr.func) == "vars" and options:
        return [(o, cst.Name(o), "vars(args) -> ") for o in options]
    if isinstance(expr, cst.Dict) or (isinstance(expr, cst.Call) and _name(expr.func) == "dict"):
        return _inline_entries(expr)
    return None


def _inline_entries(expr) -> list[tuple[str, object, str]] | None:
    """`**{"k": v}`, `**dict(k=v)`: literal keys only (anything else: unknown)."""
    import libcst as cst

    out = []
    items = expr.elements if isinstance(expr, cst.Dict) else expr.args
    for item in items:
        key = _key(item.key) if isinstance(item, cst.DictElement) else getattr(item.keyword, "value", None)
        if key is None:
            return None
        out.append((key, item.value, ""))
    return out


def _resolve(call: Call, flow: Flow, options: Sequence[str]) -> Call:
    import libcst as cst

    args, left, names = list(call.args), [], []
    own = flow.kwargs.get(call.scope or "")
    forwards = False
    for expr in call.spread:
        if own is not None and isinstance(expr, cst.Name) and expr.value == own:
            forwards = True
            left.append(expr)
            continue
        found = _spread_entries(expr, flow, options)
        if found is None:
            left.append(expr)
        else:
            args += found
            names.append(f"**{expr.value}" if isinstance(expr, cst.Name) else "**...")
    shown = f"{call.callee}({'..., ' if call.args or left else ''}{', '.join(names)})"
    return Call(call.callee, call.method, args, call.where, left, call.starred, call.scope, call.also_sets, forwards,
                shown if names else "", len(call.args))


def sets(call: Call, params: Sequence[str]) -> set[str] | None:
    """The parameters a call sets; None when a `*args` or an unresolved `**` hides which."""
    if call.starred or call.spread:
        return None
    positional = sum(1 for kw, _, _ in call.args if kw is None)
    return {kw for kw, _, _ in call.args if kw is not None} | set(params[:positional]) | set(call.also_sets)


def expand(calls: Sequence[Call], flow: Flow, params: dict[str, list[str]], options: Sequence[str]) -> list[Call]:
    """The calls with dict spreads turned into keywords, plus one call per caller of a function that forwards its
    **kwargs, carrying the keywords that function does not name itself."""
    out = [_resolve(c, flow, options) for c in calls]
    frontier = out
    for _ in range(MAX_DEPTH):
        new = []
        for fwd in (c for c in frontier if c.forwards):
            named = set(params.get(fwd.scope or "", []))
            own = sets(Call(fwd.callee, fwd.method, fwd.args, fwd.where), params.get(fwd.callee, [])) or set()
            for caller in (c for c in out if c.callee == fwd.scope and c is not fwd):
                extra = [(kw, e, f"{caller.callee}(**{flow.kwargs[fwd.scope]}) -> {via}")
                         for kw, e, via in caller.args if kw is not None and kw not in named]
                new.append(Call(fwd.callee, fwd.method, extra, caller.where, list(caller.spread), caller.starred,
                                caller.scope, frozenset(own), written=0))
        if not new:
            break
        out += new
        frontier = new
    return out


def spread_sites(calls: Sequence[Call], params: dict[str, list[str]]) -> list[tuple[object, str, str, bool, str]]:
    """Knob sites of keywords that reach a callee outside the script through a spread or forwarding:
    `nn.Linear(**kw)`, `GPT2Config(**cfg)` with cfg['vocab_size'], `DataLoader(ds, **loader_args)`."""
    out = []
    for call in calls:
        if call.callee in params:
            continue  # the script's own: followed through its parameters
        for kw, expr, via in call.args[call.written or 0:]:  # expand() set `written`
            if kw is None:
                continue
            if call.callee in MODULE_DIMS:
                if any(kw == k for _, k in MODULE_DIMS[call.callee]):
                    out.append((expr, f"{via}nn.{call.callee}({kw})", call.where, True, "model"))
            elif kw in DIM_KEYWORDS and kw != "size":
                out.append((expr, f"{via}{call.callee}({kw}=)", call.where, True, KEYWORD_ROLES.get(kw, "model")))
    return out


# ------------------------------------------------------------------ overridden defaults


def overridden_default(owner: str | None, param: str, calls: Sequence[Call],
                       params: dict[str, list[str]]) -> str | None:
    """Why a parameter's or field's default is never used: every call that builds `owner` sets `param`."""
    if owner is None or param not in params.get(owner, []):
        return None
    forwarders = {c.scope for c in calls if c.forwards and any(x.callee == c.scope for x in calls)}
    building = [c for c in calls if c.callee == owner and not (c.forwards and c.scope in forwarders)]
    if not building:
        return None
    for call in building:
        passed = sets(call, params[owner])
        if passed is None or param not in passed:
            return None
    first = building[0]
    how = first.shown or f"{owner}(...)"
    how += f" ({len(building)} calls)" if len(building) > 1 else ""
    return f"overridden: {how} at {first.where} sets {param}, so this default is never used"


def overridden_global(file: str, name: str, line: int, flow: Flow, script_args: Sequence[str],
                      config_files: dict[str, dict[str, int]]) -> str | None:
    """Why a module-level value is not the one used: set again later, or by the configurator's arguments."""
    lines = flow.top.get((file, name), [])
    if line not in lines:
        return None  # not a module-level, unconditional assignment
    later = [n for n in lines if n > line]
    if later:
        return f"overridden: {name} is set again at {Path(file).name}:{later[0]}"
    if flow.configurator is None or flow.configurator[0] != file or flow.configurator[1] < line:
        return None  # no configurator runs after it
    at = f"the configurator at {Path(file).name}:{flow.configurator[1]}"
    for arg in script_args:
        if arg.startswith(f"--{name}="):
            return f"overridden: {arg} on the command line ({at})"
    for config, names in config_files.items():
        if name in names:
            return f"overridden: {config}:{names[name]} sets {name} ({at})"
    return None


def config_files(script: Path, script_args: Sequence[str]) -> list[Path]:
    """Config files a nanoGPT-style configurator executes: the arguments that are Python files in the script's
    directory (scanned as part of the script)."""
    root = script.parent.resolve()
    out = []
    for arg in script_args:
        if arg.startswith("-") or not arg.endswith(".py"):
            continue
        for base in (Path.cwd(), root):
            path = (base / arg).resolve()
            if path.is_file() and path.is_relative_to(root):
                out.append(path)
                break
    return out


def overridden_command_line(options: Sequence[str], script_args: Sequence[str]) -> str | None:
    """An argparse option given in the script's arguments: its default is not used."""
    for arg in script_args:
        if arg == "--":
            break
        for opt in options:
            if arg == opt or (opt.startswith("--") and arg.startswith(opt + "=")):
                return f"{opt} is given on the command line: the default is not used"
    return None
