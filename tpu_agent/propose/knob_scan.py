"""Knob discovery's scan: a script and the modules of its directory that it imports, read with libcst (no code
run), into the integer literals that could be sizes (`Def`: constants, argparse and parameter defaults, dataclass
fields) and the places a value reaches a size argument (`Scan.sites`). knobs.py decides which are knobs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from tpu_agent.propose import config_flow
from tpu_agent.propose.config_flow import Call, Flow
from tpu_agent.propose.size_args import DATA_BASES, DIM_KEYWORDS, FACTORIES, KEYWORD_ROLES, MODULE_DIMS, SIZE_METHODS

MAX_FILES = 50

Where = Literal["constant", "argparse", "parameter", "literal"]




@dataclass
class Def:
    ident: str
    file: str
    line: int
    column: int
    value: int
    where: Where
    name: str
    options: tuple[str, ...] = ()
    owner: str | None = None  # a parameter's callable, a field's class: who takes the default


@dataclass
class Scan:
    defs: list[Def] = field(default_factory=list)
    # (expression, use, "file:line", literal ok, role: what the use sizes, see Role)
    sites: list[tuple[object, str, str, bool, str]] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    flow: Flow = field(default_factory=Flow)
    params: dict[str, list[str]] = field(default_factory=dict)  # local callable -> its parameters (no self)
    files: list[str] = field(default_factory=list)
    positions: dict[int, tuple[str, int, int, int, str]] = field(default_factory=dict)  # id(Integer) -> file, line, col, value, scope
    trees: list = field(default_factory=list)  # keeps the visited trees alive, so node ids stay unique
    config_files: list[str] = field(default_factory=list)  # run by the script's configurator, from its arguments
    data_classes: set[str] = field(default_factory=set)  # the script's Dataset/Sampler subclasses


def _full_name(node) -> str:
    from libcst.helpers import get_full_name_for_node

    return get_full_name_for_node(node) or ""


def _string(node) -> str | None:
    import libcst as cst

    if isinstance(node, cst.SimpleString):
        value = node.evaluated_value
        return value if isinstance(value, str) else None
    return None


class _Collector:
    """Builds the libcst visitor for one file and feeds `Scan`."""

    def __init__(self, scan: Scan, rel: str):
        self.scan = scan
        self.rel = rel

    def visitor(self):
        import libcst as cst
        from libcst.metadata import PositionProvider

        collector = self

        class Visitor(cst.CSTVisitor):
            METADATA_DEPENDENCIES = (PositionProvider,)

            def __init__(self):
                super().__init__()
                self.scopes: list[tuple[str, str]] = []  # ("class" | "def", name)

            def pos(self, node) -> tuple[int, int]:
                start = self.get_metadata(PositionProvider, node).start
                return start.line, start.column

            def at(self, node) -> str:
                return f"{Path(collector.rel).name}:{self.pos(node)[0]}"

            def add_def(self, ident: str, node, where: Where, name: str, options=(), owner=None) -> None:
                if isinstance(node, cst.Integer):
                    value = node.evaluated_value
                    if isinstance(value, int) and value >= 2:
                        line, col = self.pos(node)
                        collector.scan.defs.append(Def(ident, collector.rel, line, col, value, where, name,
                                                        tuple(options), owner))

            def visit_Integer(self, node):
                value = node.evaluated_value
                if isinstance(value, int) and value >= 2:
                    scope = ".".join(name for _, name in self.scopes) or "<module>"
                    collector.scan.positions[id(node)] = (collector.rel, *self.pos(node), value, scope)

            # scopes
            def visit_ClassDef(self, node):
                self.scopes.append(("class", node.name.value))
                if any(_full_name(b.value).rsplit(".", 1)[-1] in DATA_BASES for b in node.bases):
                    collector.scan.data_classes.add(node.name.value)

            def leave_ClassDef(self, node):
                self.scopes.pop()

            def visit_FunctionDef(self, node):
                params = [p for p in (*node.params.posonly_params, *node.params.params)]
                names = [p.name.value for p in params] + [p.name.value for p in node.params.kwonly_params]
                in_class = bool(self.scopes) and self.scopes[-1][0] == "class"
                if in_class and names and names[0] in ("self", "cls"):
                    names = names[1:]
                if in_class and node.name.value == "__init__":
                    collector.scan.params[self.scopes[-1][1]] = names
                else:
                    collector.scan.params.setdefault(node.name.value, names)
                self.scopes.append(("def", node.name.value))
                owner = config_flow.callable_key(self.scopes)
                for p in (*params, *node.params.kwonly_params):
                    if p.default is not None:
                        self.add_def(p.name.value, p.default, "parameter", p.name.value, owner=owner)

            def leave_FunctionDef(self, node):
                self.scopes.pop()

            # constants
            def visit_Assign(self, node):
                if len(node.targets) == 1 and isinstance(node.targets[0].target, cst.Name):
                    name = node.targets[0].target.value
                    self.add_def(name, node.value, "constant", name)

            def visit_AnnAssign(self, node):
                if isinstance(node.target, cst.Name) and node.value is not None:
                    owner = self.scopes[-1][1] if self.scopes and self.scopes[-1][0] == "class" else None
                    if owner in collector.scan.flow.fields:  # a dataclass field: its __init__'s default
                        self.add_def(node.target.value, node.value, "parameter", node.target.value, owner=owner)
                    else:
                        self.add_def(node.target.value, node.value, "constant", node.target.value)

            # calls
            def visit_Call(self, node):
                full = _full_name(node.func)
                last = full.rsplit(".", 1)[-1]
                positional = [a.value for a in node.args if a.keyword is None and not a.star]
                keywords = {a.keyword.value: a.value for a in node.args if a.keyword is not None}
                where = self.at(node)

                classes = [name for kind, name in self.scopes if kind == "class"]
                in_model = bool(classes) and not collector.scan.data_classes.intersection(classes)

                def site(expr, use, literal_ok=True, role=None):
                    # a tensor made outside any class, or in a Dataset's, is data (inputs, labels); inside any
                    # other class, part of the model
                    collector.scan.sites.append((expr, use, where, literal_ok, role or ("model" if in_model else "data")))

                if last == "add_argument":
                    self.argparse(node, positional, keywords)
                if last in MODULE_DIMS and (full == last or ".nn." in f".{full}" or full.startswith("nn.")):
                    for index, kw in MODULE_DIMS[last]:
                        expr = keywords.get(kw) if index is None or index >= len(positional) else positional[index]
                        if expr is not None:
                            site(expr, f"nn.{last}({kw})", role="model")
                elif full.startswith("torch.") and last in FACTORIES and full.count(".") == 1:
                    if last in ("randint",):
                        chosen = [e for e in positional if isinstance(e, (cst.Tuple, cst.List))]
                        bounds = [e for e in positional if not isinstance(e, (cst.Tuple, cst.List))]
                        if bounds:  # the values drawn (token ids, class labels): what the data holds
                            site(bounds[-1], "torch.randint(high)")
                    elif last == "full":
                        chosen = positional[:1]
                    elif last == "linspace":
                        chosen = positional[2:3]
                    elif last == "arange":
                        chosen = positional[:2]
                    else:
                        chosen = positional
                    for expr in chosen:
                        site(expr, f"torch.{last} size")
                    if "size" in keywords:
                        site(keywords["size"], f"torch.{last} size")
                elif full == "torch.reshape" and len(positional) > 1:
                    site(positional[1], "torch.reshape", literal_ok=False, role="follows")
                elif isinstance(node.func, cst.Attribute) and last in SIZE_METHODS and not full.startswith("torch."):
                    chosen = positional[1:] if last == "unflatten" else positional[:1] if last == "new_full" else positional
                    for expr in chosen:
                        # A bare literal here must agree with the tensor's size: padding it alone breaks the view.
                        site(expr, f".{last}()", literal_ok=not last.startswith(("view", "reshape", "expand", "repeat", "tile", "unflatten")),
                             role="follows")
                elif last == "one_hot" and len(positional) > 1:
                    site(positional[1], "F.one_hot(num_classes)")
                for kw, expr in keywords.items():
                    if kw in DIM_KEYWORDS and not (last in MODULE_DIMS and any(kw == k for _, k in MODULE_DIMS[last])):
                        if (kw == "size" and not full.startswith("torch.")) or full == "dict":
                            continue  # dict(k=v): followed where it is spread (config_flow)
                        site(expr, f"{last}({kw}=)", role=KEYWORD_ROLES.get(kw, "model"))
                spread = [a.value for a in node.args if a.star == "**"]
                if last and (last not in MODULE_DIMS or spread):
                    args = [(None, e, "") for e in positional] + [(k, e, "") for k, e in keywords.items()]
                    collector.scan.calls.append(Call(last, isinstance(node.func, cst.Attribute), args, where, spread,
                                                     any(a.star == "*" for a in node.args),
                                                     config_flow.callable_key(self.scopes)))

            def argparse(self, node, positional, keywords):
                options = tuple(s for s in (_string(e) for e in positional) if s and s.startswith("-"))
                default = keywords.get("default")
                if not options or not isinstance(default, cst.Integer):
                    return
                kind = keywords.get("type")
                if kind is not None and _full_name(kind) != "int":
                    return
                dest = _string(keywords["dest"]) if "dest" in keywords else None
                longs = [o for o in options if o.startswith("--")]
                shown = max(longs or options, key=len)
                ident = dest or shown.lstrip("-").replace("-", "_")
                self.add_def(ident, default, "argparse", shown, options)

        return Visitor()


def _local_imports(module, path: Path, root: Path) -> list[Path]:
    """The script-directory modules that `module` (at `path`) imports."""
    import libcst as cst

    found: list[Path] = []

    def resolve(base: Path, dotted: str) -> None:
        parts = [p for p in dotted.split(".") if p]
        target = base.joinpath(*parts) if parts else base
        for candidate in (target.with_suffix(".py") if parts else None, target / "__init__.py"):
            if candidate is not None and candidate.is_file() and candidate.resolve().is_relative_to(root):
                found.append(candidate)

    class Imports(cst.CSTVisitor):
        def visit_Import(self, node):
            for alias in node.names:
                resolve(root, _full_name(alias.name))

        def visit_ImportFrom(self, node):
            dots = len(node.relative)
            base = root if dots == 0 else path.parent.joinpath(*([".."] * (dots - 1))).resolve()
            dotted = _full_name(node.module) if node.module is not None else ""
            resolve(base, dotted)
            if not isinstance(node.names, cst.ImportStar):
                for alias in node.names:  # `from pkg import sizes` may name a module
                    resolve(base, f"{dotted}.{_full_name(alias.name)}")

    module.visit(Imports())
    return found


def scan_files(script: Path, script_args: Sequence[str] = ()) -> Scan:
    import libcst as cst
    from libcst.metadata import MetadataWrapper

    root = script.parent.resolve()
    scan = Scan()
    queue, seen, configs_read = [script.resolve()], set(), False
    while (queue or (scan.flow.configurator and not configs_read)) and len(seen) < MAX_FILES:
        if not queue:  # a nanoGPT-style configurator runs the config files given on the command line
            queue, configs_read = config_flow.config_files(script, script_args), True
            scan.config_files = [p.relative_to(root).as_posix() for p in queue]
            continue
        path = queue.pop(0)
        if path in seen:
            continue
        seen.add(path)
        try:
            module = cst.parse_module(path.read_bytes())
        except (OSError, cst.ParserSyntaxError):
            if path == script.resolve():
                raise
            continue  # a helper module we cannot read is skipped, not fatal
        rel = path.relative_to(root).as_posix()
        scan.files.append(rel)
        wrapper = MetadataWrapper(module)
        scan.trees.append(wrapper)
        wrapper.visit(config_flow.collector(scan.flow, rel))  # first: the visitor below asks which classes are records
        wrapper.visit(_Collector(scan, rel).visitor())
        queue.extend(_local_imports(module, path, root))
    for cls, fields in scan.flow.fields.items():
        scan.params.setdefault(cls, fields)  # a dataclass is called with its fields
    return scan


# ------------------------------------------------------------------ analysis
