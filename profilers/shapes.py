"""Shapes that change from step to step: which dims, their sizes, where they are made, and what they cost.

A variable batch length is the first thing that slows PyTorch training on an
XLA device: every new length compiles the step's programs again. The
diagnosis joins three views of the run: the batches the loaders yielded
(`batches.BatchWatch`), the programs compiled for more than one shape, and
the lines of the script that pad batches to their own longest sequence.
"""

from __future__ import annotations

import ast
import os
import re
from collections import defaultdict
from pathlib import Path

from .batches import BatchWatch
from .recompile_schema import DimBound, ProgramShapes, Recompiling, VaryingDim
from .schema import Step

# Calls that pad a batch to its own longest sequence (or bound its length): where a length is made.
_PADDING_CALLS = ("pad_sequence", "DataCollatorWithPadding", "DataCollatorForSeq2Seq", "DataCollatorForLanguageModeling",
                  "DataCollatorForTokenClassification", "mark_dynamic")
_NAMED_PADS = {"labels": -100, "label": -100, "attention_mask": 0, "token_type_ids": 0}
MAX_SOURCES = 8


class TransferWatch:
    """The lines that copy CPU tensors to the device, with the shapes they copied (the profiler installs it)."""

    def __init__(self):
        self.sites: dict[str, set[tuple[int, ...]]] = defaultdict(set)

    def __call__(self, t) -> None:
        from tpu_agent.backend.core.source import user_frame

        site = user_frame(3)
        if site is not None and len(self.sites[site]) < 64:
            self.sites[site].add(tuple(t.shape))


def batch_dims(watch: BatchWatch) -> list[VaryingDim]:
    """Every dim of a batch tensor that took more than one size, the lengths' own dims first."""
    out = []
    for path, seen in watch.tensors.items():
        shapes = [shape for _, shape in seen.shapes]
        if not shapes or len({len(s) for s in shapes}) != 1:
            continue
        for dim in range(1, len(shapes[0])):  # dim 0 is the batch: a last, short batch is not a length
            sizes = [s[dim] for s in shapes]
            if len(set(sizes)) < 2:
                continue
            value, observed = _pad_value(path, seen)
            out.append(VaryingDim(tensor=path, dim=dim, sizes=sorted(set(sizes)), by_batch=sizes[:200],
                                  dtype=seen.dtype, rows=sorted({s[0] for s in shapes}), pad_value=value,
                                  pad_value_seen=observed))
    return out


def _pad_value(path: str, seen) -> tuple[float | None, bool]:
    """The value ending the padded rows, when the batches show one clearly; else the usual one for its name."""
    name = path.rsplit("[", 1)[-1].strip("[]'\"") if path else ""
    if seen.tail_values:
        (value, count), = seen.tail_values.most_common(1)
        if count >= max(2, sum(seen.tail_values.values()) // 3):
            return float(value), True
    if name in _NAMED_PADS:
        return float(_NAMED_PADS[name]), False
    return (0.0, False) if seen.tail_values or seen.dtype.startswith(("float", "bfloat")) else (None, False)


def programs(ran, registered_steps: dict[int, int], warmup: int) -> list[ProgramShapes]:
    """Programs with more than one shape, at least one compiled after warm-up: the recompiled ones."""
    groups: dict[tuple, list] = defaultdict(list)
    for exe in ran:
        key = (exe.kind, exe.ops) if exe.ops else (exe.kind, exe.name)
        groups[key].append(exe)
    out = []
    for members in groups.values():
        late = [e for e in members if (registered_steps.get(e.id) or 0) > max(warmup, 1)]
        if len(members) < 2 or not late:
            continue
        timed = [e.compile_s for e in members if e.compile_s is not None]
        out.append(ProgramShapes(program=members[0].name, kind=members[0].kind, shapes=len(members),
                                 varying=_varying_args(members), compile_s=sum(timed) if timed else None))
    return sorted(out, key=lambda p: (-p.shapes, -(p.compile_s or 0.0)))


def _varying_args(members) -> list[str]:
    shapes = [[getattr(a, "shape", None) for a in e.args] for e in members]
    if len({len(s) for s in shapes}) != 1:
        return []
    found = []
    for i, column in enumerate(zip(*shapes)):
        if any(s is None for s in column) or len({len(s) for s in column}) != 1:
            continue
        for dim in range(len(column[0])):
            sizes = sorted({s[dim] for s in column})
            if len(sizes) > 1:
                found.append(f"arg {i} dim {dim}: {_sizes(sizes)}")
    return found[:6]


def _sizes(sizes: list[int], shown: int = 8) -> str:
    text = ", ".join(map(str, sizes[:shown]))
    return text + (f" (+{len(sizes) - shown} more)" if len(sizes) > shown else "")


def sources(script: str, watch: BatchWatch | None, transfers: TransferWatch | None) -> list[str]:
    """Where the lengths are made: the collate functions, the script's padding calls, the copies to the device
    that carried more than one shape."""
    out = []
    if watch is not None:
        out += [f"collate: {c}" for c in watch.collates]
    out += _padding_calls(script)
    if transfers is not None:
        for site, shapes in transfers.sites.items():
            if len(shapes) > 1 and len({len(s) for s in shapes}) == 1:
                out.append(f"copied to the device at {site} ({len(shapes)} shapes)")
    return out[:MAX_SOURCES]


def _padding_calls(script: str) -> list[str]:
    """The script's calls that make a batch's length: a padding function or collator, `padding=True` or
    `"longest"` (a tokenizer), `mark_dynamic`."""
    lines, calls = _calls(script)
    found = set()
    for node in calls:
        name = _name(node)
        pads = any(k.arg == "padding" and isinstance(k.value, ast.Constant) and k.value.value in (True, "longest")
                   for k in node.keywords)
        if name in _PADDING_CALLS or pads or any(k.arg == "pad_to_multiple_of" for k in node.keywords):
            found.add(node.lineno)
    name = os.path.basename(script)
    return [f"{name}:{n}: {lines[n - 1].strip()[:80]}" for n in sorted(found)]


def _calls(script: str):
    """(the script's lines, its Call nodes), or ([], []) when it cannot be read or parsed."""
    try:
        text = Path(script).read_text(errors="replace")
        tree = ast.parse(text)
    except (OSError, SyntaxError, ValueError):
        return [], []
    return text.splitlines(), [n for n in ast.walk(tree) if isinstance(n, ast.Call)]


def _name(call: ast.Call) -> str:
    return call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")


def _int_arg(call: ast.Call, position: int, *keywords: str) -> int | None:
    node = next((k.value for k in call.keywords if k.arg in keywords), None)
    if node is None and len(call.args) > position:
        node = call.args[position]
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    return None


def bounds(script: str) -> list[DimBound]:
    """The script's `mark_dynamic(x, dim, min, max)` calls (keywords min=/max= too) with a literal dim: the
    lengths it declares, honoured by the buckets proposed."""
    _, calls = _calls(script)
    out = []
    for call in calls:
        if _name(call) != "mark_dynamic":
            continue
        dim = _int_arg(call, 1, "index", "dim")
        if dim is None:
            continue
        out.append(DimBound(dim=dim, min=_int_arg(call, 2, "min"), max=_int_arg(call, 3, "max"),
                            source=f"{os.path.basename(script)}:{call.lineno}"))
    return out


def diagnose(steps: list[Step], warmup: int, dims: list[VaryingDim], progs: list[ProgramShapes],
             found_sources: list[str], declared: list[DimBound] = ()) -> Recompiling | None:
    """The verdict, when measured steps compile again and again (None: shapes settle after warm-up)."""
    measured = [s for s in steps if not s.warmup]
    compiling = [s for s in measured if s.compiled]
    if len(compiling) < max(2, len(measured) / 5) or not (dims or progs):  # a late compile or two: no churn
        return None
    compile_s = sum(s.compile_s for s in steps)
    run_s = sum(s.wall_s for s in steps)
    share = compile_s / run_s if run_s > 0 else 0.0
    if dims:
        main = max(dims, key=lambda d: len(d.sizes))
        what = f"{len(main.sizes)} shapes of dim {main.dim} of the batch's {main.tensor or 'tensor'}"
    else:
        main = progs[0]
        what = f"{main.shapes} shapes of {main.program}"
    verdict = (f"recompiling: {what} in {len(steps)} steps ({len(compiling)} of {len(measured)} measured steps "
               f"compiled), {share * 100:.0f} % of the run compiling")
    return Recompiling(verdict=verdict, steps=len(steps), compiling_steps=len(compiling), compile_s=compile_s,
                       run_s=run_s, compile_share=share, batch_dims=dims, programs=progs[:10],
                       sources=found_sources, bounds=list(declared))


def varying_sizes(rec: Recompiling | None) -> set[int]:
    """Sizes that change from step to step, and their usual relatives (shifted by one, times the batch)."""
    if rec is None:
        return set()
    out: set[int] = set()
    for d in rec.batch_dims:
        for n in d.sizes:
            near = {n, n - 1, n + 1}
            out.update(near | {b * m for b in d.rows for m in near})
    for p in rec.programs:
        for text in p.varying:
            out.update(int(x) for x in re.findall(r"\b\d+\b", text.split(":", 1)[1]))
    return {n for n in out if n > 1}
