"""`tpu-agent diff BASE HEAD [--fail-above PCT]`: two profiles or reports as a markdown table, for CI.

Markdown on stdout so a CI job can post it on a pull request as is. Step time
and XLA peak memory gate (exit 1 when HEAD is worse beyond the threshold);
FLOPs, MFU, live memory, padding waste and the warm-up (first step, overhead, programs compiled) are
shown, not gated: padding adds
FLOPs on purpose, MFU moves with FLOPs as well as with speed, and live memory
grows with the number of steps a leaky script was profiled for. Distributed profiles (`profile --nproc N`)
add their per-rank figures below the table (diff_ranks.py).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Callable

import typer

from tpu_agent.cli.format import ms, percent, si, size
from tpu_agent.errors import InputError
from tpu_agent.report.summary import Summary, load_summary


@dataclass(frozen=True)
class Metric:
    label: str
    field: str
    fmt: Callable[[float], str]
    lower_is_better: bool | None  # None: no direction (shown, never "better" or "worse")
    gated: bool
    points: bool = False  # a share: the change is shown in percentage points


def _flops(v: float) -> str:
    return si(v, "FLOP")


METRICS = (
    Metric("step time (median)", "step_time_s", ms, True, True),
    Metric("FLOPs / step", "flops_per_step", _flops, None, False),
    Metric("MFU", "mfu", percent, False, False, points=True),
    Metric("peak memory (XLA, per device)", "peak_memory_bytes", size, True, True),
    # Not gated: buffers a script keeps across steps make it grow with the number of steps profiled.
    Metric("live memory peak (measured)", "live_peak_bytes", size, True, False),
    Metric("in-step memory peak (measured)", "step_peak_bytes", size, True, False),
    Metric("padding waste (estimate)", "padding_waste", percent, True, False, points=True),
    # Not gated: a first step's time is mostly compiling, which a warm compilation cache removes.
    Metric("first step", "first_step_s", ms, True, False),
    Metric("warm-up overhead", "warmup_overhead_s", ms, True, False),
    Metric("programs compiled", "programs_compiled", lambda v: f"{v:.0f}", True, False),
)


@dataclass
class Row:
    metric: Metric
    base: float | None
    head: float | None
    change: float | None  # relative, or percentage points for shares
    verdict: str
    regression: bool


def compare(base: Summary, head: Summary, fail_above: float | None) -> list[Row]:
    rows = []
    for m in METRICS:
        b, h = getattr(base, m.field), getattr(head, m.field)
        change = None
        verdict, regression = "", False
        if b is not None and h is not None:
            if m.points:
                change = h - b
            elif b:
                change = h / b - 1.0
            if change is not None and m.lower_is_better is not None and change != 0:
                worse = (change > 0) == m.lower_is_better
                verdict = "worse" if worse else "better"
                if worse and m.gated and fail_above is not None and abs(change) * 100 > fail_above:
                    regression = True
                    verdict = f"**regression** (> {fail_above:g} %)"
        rows.append(Row(m, b, h, change, verdict, regression))
    return rows


def _change_text(row: Row) -> str:
    if row.change is None:
        return "n/a"
    if row.metric.points:
        return f"{row.change * 100:+.2f} pp"
    return f"{row.change:+.1%}"


def markdown(base: Summary, head: Summary, rows: list[Row], *, base_name: str, head_name: str,
             fail_above: float | None) -> str:
    script = head.script or base.script
    lines = [f"### tpu-agent diff{f': {script}' if script else ''}", "",
             f"| metric | base | head | change | |", "|---|---:|---:|---:|---|"]
    for r in rows:
        fmt = r.metric.fmt
        b = fmt(r.base) if r.base is not None else "n/a"
        h = fmt(r.head) if r.head is not None else "n/a"
        lines.append(f"| {r.metric.label} | {b} | {h} | {_change_text(r)} | {r.verdict} |")
    lines.append("")
    regressions = [r for r in rows if r.regression]
    if fail_above is None:
        lines.append("No threshold given (`--fail-above PCT`): nothing gated.")
    elif regressions:
        listed = ", ".join(f"{r.metric.label} {_change_text(r)}" for r in regressions)
        lines.append(f"**Regression beyond {fail_above:g} %:** {listed}.")
    else:
        lines.append(f"No regression beyond {fail_above:g} % in step time or peak memory.")
    notes = [f"base: `{base_name}` ({base.source}), head: `{head_name}` ({head.source})."]
    if base.script and head.script and base.script != head.script:
        notes.append(f"Different scripts ({base.script} vs {head.script}).")
    if base.device and head.device and base.device != head.device:
        notes.append(f"Different devices (base {base.device}, head {head.device}): times and MFU compare poorly.")
    if (base.steps_measured or 0) < 3 or (head.steps_measured or 0) < 3:
        notes.append("A side measured fewer than 3 steps: its step time is one noisy sample.")
    if base.padding_generation and head.padding_generation and base.padding_generation != head.padding_generation:
        notes.append(f"Padding waste modelled for different TPUs ({base.padding_generation} vs {head.padding_generation}).")
    lines.append("")
    lines.extend(f"- {n}" for n in notes)
    return "\n".join(lines) + "\n"


def diff(
    base: Annotated[Path, typer.Argument(metavar="BASE", help="profile.json or report.json (or a run directory) to compare against.", show_default=False)],
    head: Annotated[Path, typer.Argument(metavar="HEAD", help="profile.json or report.json (or a run directory) of the change.", show_default=False)],
    fail_above: Annotated[
        float | None,
        typer.Option("--fail-above", metavar="PCT", help="Exit 1 when HEAD's step time or XLA peak memory is worse than BASE's by more than PCT percent.",
                     show_default=False),
    ] = None,
) -> int:
    """Compare two profiles or reports as a markdown table: step time, FLOPs, MFU, memory, padding waste; for
    distributed profiles, also each rank's step time, memory, communication share and collectives.

    Exit 0, or 1 on a regression beyond --fail-above, or 2 on bad input.
    Example: [bold]tpu-agent diff main/profile.json pr/profile.json --fail-above 5[/bold]
    """
    if fail_above is not None and not fail_above >= 0:
        raise InputError(f"--fail-above takes a percentage >= 0, got {fail_above:g}")
    b, h = load_summary(base), load_summary(head)
    rows = compare(b, h, fail_above)
    from tpu_agent.cli.diff_ranks import load_distributed, markdown as ranks_markdown

    sys.stdout.write(markdown(b, h, rows, base_name=str(base), head_name=str(head), fail_above=fail_above)
                     + ranks_markdown(load_distributed(base), load_distributed(head)))
    return 1 if any(r.regression for r in rows) else 0


def register(app: typer.Typer) -> None:
    app.command("diff")(diff)
