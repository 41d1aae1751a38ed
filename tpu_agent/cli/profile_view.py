"""The terminal summary of a profile: what a person reads before anything is tuned.

Estimates (the TPU padding model, the roofline) say "estimate" beside them.
"""

from __future__ import annotations

import io
import shlex
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from tpu_agent.cli.format import ms, si, size
from tpu_agent.paths import shown_path
from tpu_agent.profilers.schema import Profile

HOT_ROWS = 10
PADDING_ROWS = 8


def _relative(path: str | None) -> str:
    return shown_path(path) if path else ""


def _headline(p: Profile) -> Text:
    n = len(p.steps.items)
    status = {
        "stopped": f"stopped by --steps after {n} steps",
        "complete": f"the script ended after {n} step{'s' if n != 1 else ''}" if not p.steps.whole_run else "the script ended",
        "failed": f"the script failed (exit {p.exit_code}) "
                  + ("before any step marker" if p.steps.whole_run else f"after {n} step{'s' if n != 1 else ''}"),
    }[p.status]
    style = "red" if p.status == "failed" else "bold"
    return Text.assemble(("profile ", "bold"), (Path(p.script).name, "bold cyan"),
                         f"  ({p.mode_used} mode, {p.settings.warmup} warm-up; ", (status, style), ")")


def _rows(p: Profile) -> list[tuple[str, Text | str]]:
    rows: list[tuple[str, Text | str]] = []
    if p.device:
        d = p.device
        dev = f"{d.platform} ({d.device_kind}), {d.count} device{'s' if d.count != 1 else ''}"
        if d.emulated and d.generation:
            dev += f"; the bundled tpu device reports TPU {d.generation}"
        rows.append(("device", dev))
    st = p.steps.stats
    if st is not None:
        label = "region time" if p.steps.whole_run else "step time"
        rows.append((label, Text.assemble((f"median {ms(st.median_s)}", "bold"),
                                          f"  p10 {ms(st.p10_s)}  p90 {ms(st.p90_s)}  over {st.count} step(s): {st.basis}")))
    rows.append(("compile", f"{p.steps.compile_s:.3g} s in {p.steps.compiles} XLA compilation(s), measured"))
    if p.warmup is not None:
        rows.append(("warm-up", warmup_line(p)))
    f = p.flops
    if f is not None:
        rows.append(("FLOPs/step", Text.assemble((si(f.per_step, "FLOP"), "bold"),
                                                 f" (XLA cost analysis; dots and convolutions {si(f.dot_conv_per_step, 'FLOP')})")))
        if f.check is not None:
            c = f.check
            verdict = (Text(f"agree within {c.tolerance:.0%}", style="green") if c.agrees
                       else Text("no ratio", style="yellow") if c.relative_difference is None
                       else Text(f"differ by more than {c.tolerance:.0%}", style="yellow"))
            rows.append(("cross-check", Text.assemble(
                f"{c.region}: XLA {si(c.xla_flops, 'FLOP')} vs FlopCounterMode {si(c.flop_counter_flops, 'FLOP')}",
                (f" ({c.relative_difference:+.1%}): " if c.relative_difference is not None else ": "), verdict,
                f"; {c.explanation}")))
        rows.append(("bytes/step", f"{size(f.bytes_per_step)} accessed (XLA cost analysis)"))
        if f.achieved_flops_per_s is not None:
            tp = Text(f"{si(f.achieved_flops_per_s, 'FLOP/s')} achieved")
            if f.peak is not None and f.mfu is not None:
                kind = "measured peak" if f.peak.measured else "datasheet peak"
                tp.append("; MFU ")
                tp.append(f"{f.mfu:.1%}", style="bold")
                tp.append(f" of {si(f.peak.flops_per_s, 'FLOP/s')} ({kind}, {f.peak.dtype})")
            rows.append(("throughput", tp))
    if p.host_device is not None:
        rows.append(("host/device", host_device_line(p)))
    m = p.memory
    mem = f"XLA peak {size(m.xla_peak_bytes)}"
    if m.xla_peak_executable:
        mem += f" ({m.xla_peak_executable})"
    mem += f"; live device buffers: peak {size(m.live_peak_bytes)}, at the end {size(m.live_end_bytes)}"
    if m.step_peak_bytes is not None:
        mem += f"; in-step peak {size(m.step_peak_bytes)} (measured)"
    if m.device_stats.get("peak_bytes_in_use"):
        mem += f"; runtime peak {size(m.device_stats['peak_bytes_in_use'])}"
    rows.append(("memory", mem))
    if p.transfers is not None:
        t = p.transfers
        rows.append(("transfers", f"host->device {t.h2d_count} ({size(t.h2d_bytes)}), device->host {t.d2h_count} "
                                  f"({size(t.d2h_bytes)}); per measured step {t.h2d_count_per_step:.3g} h2d, "
                                  f"{t.d2h_count_per_step:.3g} d2h"))
    if p.recompiling is not None:
        r = p.recompiling
        text = Text(r.verdict, style="bold yellow")
        for d in r.batch_dims[:3]:
            text.append(f"\n{d.tensor or 'batch'} dim {d.dim}: {len(d.sizes)} sizes, {d.sizes[0]}-{d.sizes[-1]}")
        for where in r.sources[:4]:
            text.append(f"\nmade at {where}")
        rows.append(("shapes", text))
    if p.recompilations:
        first = p.recompilations[:3]
        desc = "; ".join(f"step {r.step}: {r.executable} ({r.reason}{', ' + ', '.join(r.shapes[:3]) if r.shapes else ''})"
                         for r in first)
        more = f" and {len(p.recompilations) - 3} more" if len(p.recompilations) > 3 else ""
        rows.append(("recompiles", Text(f"{len(p.recompilations)}: {desc}{more}", style="yellow")))
    else:
        rows.append(("recompiles", "none after warm-up"))
    gb = p.graph_breaks
    if gb.count:
        sites = "; ".join(f"{s.op or s.reason}{' at ' + s.source if s.source else ''} x{s.count}" for s in gb.sites[:3])
        more = f" and {len(gb.sites) - 3} more site(s)" if len(gb.sites) > 3 else ""
        rows.append(("graph breaks", Text(f"{gb.count} ({gb.per_step:.3g} per measured step): {sites}{more}",
                                          style="yellow")))
    elif p.mode_used != "eager":
        rows.append(("graph breaks", "none"))
    rows.append(("CPU fallbacks", ", ".join(f"{k} x{v}" for k, v in p.fallbacks.items()) or "none"))
    return rows


def warmup_line(p: Profile) -> str:
    """TorchTPU's benchmark figures: first step, warm-up until compiling stops, steady step, programs, peak memory."""
    w = p.warmup
    parts = [f"first step {ms(w.first_step_s)}" + (" (under FlopCounterMode)" if w.first_step_instrumented else "")]
    if w.compiling_steps:
        over = f", {ms(w.overhead_s)} above as many steady steps" if w.overhead_s is not None else ""
        parts.append(f"compiling stopped after step {w.compiling_steps} ({ms(w.warmup_s)}{over})")
    else:
        parts.append("no step compiled")
    if w.steady_step_s is not None:
        parts.append(f"steady {ms(w.steady_step_s)} (median of {w.steady_steps} step(s) after it)")
    else:
        parts.append("no steady step: the last step compiled")
    parts.append(f"{w.programs_compiled} program(s) compiled")
    if w.peak_bytes is not None:
        parts.append(f"peak memory {size(w.peak_bytes)} ({w.peak_source})")
    if w.memory_flat is not None:
        growth = size(abs(w.live_growth_bytes_per_step))
        sign = "+" if w.live_growth_bytes_per_step >= 0 else "-"
        parts.append(("live memory flat" if w.memory_flat else "live memory GROWS")
                     + f" ({sign}{growth} per step over {w.steady_steps} steps)")
    return "; ".join(parts) + "; measured"


def step_ranges(indices: list[int]) -> str:
    """[7, 8, 10] -> 'steps 7-8, 10'; [7] -> 'step 7'."""
    parts: list[list[int]] = []
    for i in indices:
        if parts and i == parts[-1][-1] + 1:
            parts[-1].append(i)
        else:
            parts.append([i])
    shown = ", ".join(f"{p[0]}-{p[-1]}" if len(p) > 1 else f"{p[0]}" for p in parts)
    return f"step{'s' if len(indices) > 1 else ''} {shown}"


def _pct(x: float) -> str:
    return f"{x * 100:.0f} %"


def host_device_line(p: Profile) -> Text:
    """`host-bound: 87 % of the step is host overhead (dispatch and tracing), 13 % device time (...)`."""
    h = p.host_device
    shares = (f"{_pct(h.host_share)} of the step is host overhead (dispatch and tracing), {_pct(h.device_share)} "
              "device time")
    if h.bound != "host":
        shares = f"{_pct(h.device_share)} of the step is device time, {_pct(h.host_share)} host overhead"
    head = f"{h.bound}-bound" + (" (estimate)" if h.bound_estimate else "")
    n = h.launches_per_step
    how = (f" (measured on {step_ranges(h.steps)}, every launch waited for: {ms(h.wall_s)} = {ms(h.host_s)} host + "
           f"{ms(h.device_s)} device, {n:.3g} launch{'' if n == 1 else 'es'} per step)")
    text = Text.assemble((head, "bold yellow" if h.bound == "host" else "bold"), ": ", shares, how)
    if h.bound != "host":
        text.append(f"; {h.bound_basis}")
    return text


def short_op(name: str | None) -> str:
    """aten.addmm.default -> addmm; aten.add.Tensor -> add.Tensor."""
    if not name:
        return ""
    name = name.removeprefix("aten.")
    return name.removesuffix(".default")


def _hot_table(p: Profile) -> Table | None:
    if not p.hot_ops:
        return None
    table = Table(title=f"hot ops: top {min(HOT_ROWS, len(p.hot_ops))} by FLOPs per step (from HLO shapes)",
                  title_justify="left", show_edge=False, pad_edge=False, box=None)
    for col, just in (("FLOP/step", "right"), ("share", "right"), ("op", "left"), ("shapes", "left"),
                      ("aten op", "left"), ("source", "left")):
        table.add_column(col, justify=just, overflow="fold")
    for h in p.hot_ops[:HOT_ROWS]:
        op = h.opcode
        if h.opcode == "fusion" and h.contains:
            op = f"fusion({', '.join(sorted({c.split()[0] for c in h.contains}))})"
        shapes = " @ ".join(h.operands) if h.operands else h.shape
        table.add_row(si(h.flops_per_step), f"{h.share:.1%}", op, shapes, short_op(h.aten_op), h.source or "")
    return table


def _padding_table(p: Profile) -> tuple[Text, Table | None] | None:
    pad = p.padding
    if pad is None:
        return None
    head = Text.assemble(("padding waste on TPU ", "bold"), (pad.generation, "bold"),
                         f" (MXU {pad.mxu}x{pad.mxu}): ", (f"{pad.total_waste.value:.2%}", "bold"),
                         " of dot/convolution work is tile padding ", ("(estimate)", "italic yellow"))
    if not pad.dims:
        head.append("; every dim is aligned")
        return head, None
    table = Table(show_edge=False, pad_edge=False, box=None)
    for col, just in (("size", "right"), ("padded to", "right"), ("roles", "left"),
                      ("wasted FLOP/step (estimate)", "right"), ("share", "right"), ("in", "left")):
        table.add_column(col, justify=just, overflow="fold")
    for d in pad.dims[:PADDING_ROWS]:
        first = d.ops[0].replace("aten.", "").replace(".default", "") if d.ops else ""
        more = f" (+{len(d.ops) - 1} more)" if len(d.ops) > 1 else ""
        table.add_row(str(d.size), str(d.padded_to), ",".join(d.roles), si(d.wasted_flops_per_step.value),
                      f"{d.share_of_padded_work:.2%}", first + more)
    return head, table


def render(p: Profile, console: Console) -> None:
    console.print(_headline(p))
    rows = _rows(p)
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        console.print(Text.assemble((f"  {key:<{width}}", "bold"), "  ", value))
    hot = _hot_table(p)
    if hot is not None:
        console.print()
        console.print(hot)
    pad = _padding_table(p)
    if pad is not None:
        console.print()
        console.print(pad[0])
        if pad[1] is not None:
            console.print(pad[1])
    if p.target is not None:
        t = p.target
        console.print()
        console.print(Text.assemble(
            ("on TPU ", "bold"), (t.generation, "bold"), " ", ("(estimate, roofline)", "italic yellow"),
            f": step {ms(t.step_s.value)} ({t.bound}-bound: compute {ms(t.compute_s.value)}, "
            f"memory {ms(t.memory_s.value)}), MFU {t.mfu.value:.1%}"))
    if p.distributed is not None:
        from tpu_agent.cli.ranks_view import render_ranks

        render_ranks(p.distributed, console)
    if p.notes:
        console.print()
        for note in p.notes:
            console.print(Text.assemble(("note: ", "yellow"), note))
    files = [("run dir", p.run_dir), ("plot", p.files.plot), ("HLO", p.files.hlo_dir),
             ("XLA dump", p.files.xla_dump_dir), ("trace", p.files.trace_dir)]
    console.print()
    console.print(Text("  ".join(f"{k}: {_relative(v)}" for k, v in files if v), style="dim"))
    if p.files.trace_dir:  # the measured steps, one step marker each: XProf's overview, trace viewer, op profile
        shown = shlex.quote(str(_relative(p.files.trace_dir)))
        console.print(Text(f"open the trace: xprof --logdir {shown}  (or tensorboard --logdir {shown}, Profile tab)"))


def render_to_text(p: Profile, width: int = 160) -> str:
    console = Console(width=width, file=io.StringIO(), color_system=None)
    render(p, console)
    return console.file.getvalue()
