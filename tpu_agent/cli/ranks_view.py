"""The terminal section of a distributed profile: each rank's step, memory and communication, its collectives,
and the slowest rank. Every figure is measured (collectives timed on their rank, issue to completion)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from tpu_agent.cli.format import ms, size
from tpu_agent.profilers.schema import Distributed, RankProfile


def _share(x: float | None) -> str:
    return f"{x * 100:.1f} %" if x is not None else "n/a"


def _rate(bytes_per_s: float | None) -> str:
    return f"{size(bytes_per_s)}/s" if bytes_per_s is not None else "n/a"


def _ranks_table(d: Distributed) -> Table:
    table = Table(title="ranks (measured)", title_justify="left", show_edge=False, pad_edge=False, box=None)
    runtime = any(r.runtime_peak_bytes is not None for r in d.ranks)  # TPU and GPU runtimes keep a peak
    for col in ("rank", "step (median)", "outside collectives (median)", "in collectives (mean)", "comm share",
                "in-step peak", "live peak", "XLA peak", *(("runtime peak",) if runtime else ()), "status"):
        table.add_column(col, justify="left" if col == "status" else "right")
    for r in d.ranks:
        table.add_row(str(r.rank), ms(r.step_time.median_s) if r.step_time else "n/a", ms(r.compute_s_per_step),
                      ms(r.comm_s_per_step), _share(r.comm_share), size(r.step_peak_bytes), size(r.live_peak_bytes),
                      size(r.xla_peak_bytes),
                      *((size(r.runtime_peak_bytes),) if runtime else ()),
                      r.status if r.exit_code in (0, None) else f"{r.status} (exit {r.exit_code})")
    return table


def _collectives_table(r: RankProfile) -> Table | None:
    if not r.collectives:
        return None
    table = Table(title=f"collectives on rank {r.rank} (per measured step)", title_justify="left", show_edge=False,
                  pad_edge=False, box=None)
    for col in ("op", "group", "calls", "bytes/call", "bytes", "time", "bytes/time"):
        table.add_column(col, justify="left" if col in ("op", "group") else "right")
    for c in r.collectives:
        table.add_row(c.op, ",".join(map(str, c.ranks)), f"{c.calls_per_step:.3g}", size(c.bytes_per_call),
                      size(c.bytes_per_step), ms(c.time_per_step_s), _rate(c.bandwidth))
    return table


def slowest_line(d: Distributed) -> Text:
    s = d.slowest_rank
    if s is None:
        measured = [str(r.rank) for r in d.ranks if r.step_time is not None]
        return Text(f"slowest rank: n/a (ranks that measured a step: {', '.join(measured) or 'none'})")
    figure = ms(s.compute_s_per_step) + " outside collectives" if s.compute_s_per_step is not None else ms(s.step_s)
    spread = f", {s.spread:+.1%} on the fastest rank" if s.spread is not None else ""
    return Text.assemble(("slowest rank: ", "bold"), (f"rank {s.rank}", "bold"), f" ({figure}{spread}): {s.basis}")


def render_ranks(d: Distributed, console: Console) -> None:
    console.print()
    pace = f"; the job's pace {ms(d.step_time_s)} per step (its slowest rank's median)" if d.step_time_s else ""
    console.print(Text.assemble(("distributed: ", "bold"), f"{d.world_size} ranks ({d.launcher}); "
                                f"communication {_share(d.comm_share)} of the step (mean over ranks){pace}; "
                                "collectives timed on each rank from issue to completion, waiting for the others "
                                "included"))
    if d.missing_ranks:
        console.print(Text(f"rank(s) {', '.join(map(str, d.missing_ranks))} wrote no profile", style="yellow"))
    console.print(_ranks_table(d))
    console.print(slowest_line(d))
    first = next((r for r in d.ranks if r.collectives), None)
    table = _collectives_table(first) if first is not None else None
    if table is not None:
        console.print()
        console.print(table)
        if len(d.ranks) > 1:
            console.print(Text("every rank's collectives: profile.json, distributed.ranks[R].collectives", style="dim"))
    elif not any(r.collectives for r in d.ranks):
        console.print(Text("no collective ran on tpu tensors in the measured steps", style="yellow"))
