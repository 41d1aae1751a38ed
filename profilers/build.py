"""Turns what the session collected, and the executables the backend kept, into a `Profile`.

Each section is built on its own: one that fails becomes a note, and the rest
of the profile (the partial profile of a crashed script included) is kept.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from datetime import datetime, timezone

from tpu_agent.backend.core.generations import DEFAULT_GENERATION

from . import analysis, flopcheck, hlo, peaks, shapes, warmup
from .collected import Collected, RunInfo
from .recompile_schema import GraphBreaks, GraphBreakSite, Recompilation
from .schema import Device, Executable, Files, Flops, Memory, Profile, Refused, Steps, Transfers

HOT_OPS = 25


def _guarded(notes: list[str], what: str, fn: Callable, default=None):
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001
        notes.append(f"could not compute {what}: {type(exc).__name__}: {exc}")
        return default


def _file_name(index: int, name: str) -> str:
    return f"{index:04d}-{re.sub(r'[^A-Za-z0-9_.-]+', '_', name)[:80]}.hlo.txt"


def _write_hlo(path, text: str, refused: list[Refused]) -> str | None:
    """One executable's HLO file; a refusal (a full disk) is recorded once, no half file is left, and the rest of
    the profile is built as if the files had not been asked for."""
    try:
        path.write_text(text)
    except OSError as exc:
        refused.append(Refused.of(exc, path, "the HLO files"))
        try:
            path.unlink()
        except OSError:
            pass
        return None
    return str(path)


def build_profile(d: Collected, run: RunInfo, exit_code: int, error: str | None) -> Profile:
    from tpu_agent.backend.core import executables
    from tpu_agent.backend.core.lazy import RECORDER
    from tpu_agent.backend.core.state import STATS
    from tpu_agent.backend.core.steps import trained

    s = run.settings
    notes = list(d.notes)

    # ---- which steps are measured, and the window of executable calls they cover
    steps = d.steps
    start = d.window_start
    end = d.window_end
    measured = [st for st in steps if not st.warmup]
    if end is not None and measured and (start is not None or s.warmup == 0 or d.whole_run):
        window_steps = len(measured)  # start None: the window opens at the script's start
    else:
        start = None  # warm-up never ended: measure from the script's start
        window_steps = len(steps)
        if steps:
            notes.append(f"the script ended after {len(steps)} step(s), all within the {s.warmup}-step warm-up: "
                         "FLOPs and statistics include warm-up")
    base_calls = start.calls if start else {}
    end_calls = end.calls if end else {}

    def in_window(exe) -> int:
        return end_calls.get(exe.id, 0) - base_calls.get(exe.id, 0)

    ran = [e for e in executables.all() if e.calls > 0]
    hlo_dir = run.run_dir / "hlo" if s.dump_hlo else None
    refused: list[Refused] = []  # the HLO files the environment refused: the figures stand without them
    if hlo_dir is not None:
        try:
            hlo_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            refused.append(Refused.of(exc, hlo_dir, "the HLO files"))

    infos: list[analysis.ExeInfo] = []
    exe_rows: list[Executable] = []
    region_xla = region_dot = region_pad = 0.0
    xla_peak = (None, None)
    for index, exe in enumerate(ran):
        cost = _guarded(notes, f"the cost of {exe.name}", exe.cost, {}) or {}
        memory = _guarded(notes, f"the memory of {exe.name}", exe.memory, {}) or {}
        text = _guarded(notes, f"the HLO of {exe.name}", exe.hlo_text, None)
        module = _guarded(notes, f"the HLO analysis of {exe.name}", lambda: hlo.parse_module(text), None) if text else None
        ops = hlo.hot_ops(module) if module is not None else []
        hlo_file = None
        if hlo_dir is not None and text is not None and not refused:
            path = hlo_dir / _file_name(index, exe.name)
            hlo_file = _write_hlo(path, text, refused)
        per_step = in_window(exe) / window_steps if window_steps else 0.0
        info = analysis.ExeInfo(exe.name, exe.kind, exe.source, per_step, cost.get("flops", 0.0),
                                cost.get("bytes_accessed", 0.0), ops)
        infos.append(info)
        if d.region_calls is not None:
            n = d.region_calls.get(exe.id, 0)
            region_xla += n * info.flops
            region_dot += n * info.dot_conv_flops
            region_pad += n * info.conv_padding_flops
        peak_bytes = memory.get("peak_bytes")
        if peak_bytes is not None and (xla_peak[0] is None or peak_bytes > xla_peak[0]):
            xla_peak = (peak_bytes, exe.name)
        exe_rows.append(Executable(
            name=exe.name, kind=exe.kind, source=exe.source, ops=len(exe.ops), calls=exe.calls,
            calls_per_step=per_step, time_s=exe.time_s, time_is_execution=s.time_executables,
            flops=info.flops, bytes_accessed=info.bytes_accessed, transcendentals=cost.get("transcendentals", 0.0),
            memory=memory, hlo_file=hlo_file,
        ))

    # ---- steps
    stats = analysis.step_stats(steps)
    if s.steps is not None and len(steps) < s.warmup + s.steps and not d.whole_run and exit_code == 0 and measured:
        notes.append(f"the script ended after {len(steps)} step(s), before the {s.warmup} warm-up + {s.steps} "
                     "measured steps asked for")
    if d.whole_run:
        notes.insert(0, "no step markers: the whole run is one region (no optimizer step, no torch.tpu.mark_step())")
    if d.whole_run and stats is not None:
        stats.basis = "the whole run as one region (start-up, compilation and FlopCounterMode included)"
    elif any(st.instrumented and st.device_s is None and not st.warmup for st in steps) and stats is not None:
        left_out = "FlopCounterMode" not in stats.basis
        notes.append("step 1 ran under FlopCounterMode for the FLOP cross-check: "
                     + ("it is left out of the statistics" if left_out else "its time is in the statistics (no other step)"))
    compiled_measured = [st.index for st in steps if st.compiled and not st.warmup]
    if compiled_measured and stats and "excluding" in stats.basis:
        notes.append(f"{len(compiled_measured)} measured step(s) compiled something and are left out of the "
                     f"statistics: {_ranges(compiled_measured)}")
    steps_section = Steps(markers=d.markers, whole_run=d.whole_run, stopped_by_profiler=d.stopped, items=steps,
                          stats=stats, compile_s=d.compile_s, compiles=d.compiles)

    # ---- FLOPs, peak, MFU
    flops_per_step = sum(i.flops * i.calls_per_step for i in infos)
    bytes_per_step = sum(i.bytes_accessed * i.calls_per_step for i in infos)
    ranked = run.rank is not None  # one rank of several: its own device; ranks calibrating at once would race
    device = _guarded(notes, "the device", lambda: _device(local=ranked), None)
    peak = None
    if device is not None:
        peak = _guarded(notes, "the device's peak", lambda: peaks.device_peak(
            device.platform, device.device_kind, device.count, measure=not ranked, notes=notes), None)
        if peak is None and ranked and device.platform != "tpu":
            notes.append("no MFU: this machine's peak is not calibrated yet, and ranks do not calibrate it (they "
                         "would measure it together); run `tpu-agent doctor --calibrate` once")
    achieved = flops_per_step / stats.median_s if stats and stats.median_s > 0 else None
    check = None
    if d.counter_flops is not None and d.region is not None:
        check = flopcheck.compare(d.region, region_xla, region_dot, d.counter_flops, d.counter_by_op,
                                  conv_padding_flops=region_pad)
    flops = Flops(
        per_step=flops_per_step, bytes_per_step=bytes_per_step,
        transcendentals_per_step=sum(r.transcendentals * r.calls_per_step for r in exe_rows),
        dot_conv_per_step=sum(i.dot_conv_flops * i.calls_per_step for i in infos),
        achieved_flops_per_s=achieved, peak=peak,
        mfu=achieved / peak.flops_per_s if achieved is not None and peak else None, check=check,
    )

    # ---- host overhead vs device time
    pad_gen = s.padding_generation or s.target or (device.generation if device else None) or DEFAULT_GENERATION
    target = None
    if s.target:
        target = _guarded(notes, "the roofline estimate", lambda: analysis.roofline(infos, s.target, flops_per_step))
    roof = target or _guarded(notes, "the roofline for the host/device split",
                              lambda: analysis.roofline(infos, pad_gen, flops_per_step), None)
    host_device = _guarded(notes, "the host/device split", lambda: analysis.host_device(
        steps, flops_per_step, peak.flops_per_s if peak else None, roof), None)
    notes += _host_device_notes(steps, s, host_device, d.whole_run)

    # ---- the rest
    growth = _live_growth(steps)
    if growth:
        notes.append(growth)
    memory = Memory(xla_peak_bytes=xla_peak[0], xla_peak_executable=xla_peak[1], live_peak_bytes=d.live_peak,
                    step_peak_bytes=d.step_peak, live_end_bytes=d.live_end, device_stats=d.device_stats)
    warm = _guarded(notes, "the warm-up", lambda: warmup.summarize(steps_section, memory), None)
    hot = _guarded(notes, "the hot ops", lambda: analysis.hot_ops(infos, flops_per_step, HOT_OPS), [])
    pad = _guarded(notes, "the padding report", lambda: analysis.padding_report(infos, pad_gen), None)
    recompiles = _guarded(notes, "the recompilations", lambda: _recompilations(RECORDER, d, s.warmup, ran), [])
    recompiling = _guarded(notes, "the shapes that change", lambda: _recompiling(d, run, s.warmup, ran), None)
    if pad is not None and recompiling is not None:
        vary = shapes.varying_sizes(recompiling)
        pad.varying_left_out = sorted({x.size for x in pad.dims if x.size in vary})
        pad.dims = [x for x in pad.dims if x.size not in vary]
    breaks = _guarded(notes, "the graph breaks",
                      lambda: _graph_breaks(RECORDER, d, start, end, window_steps), GraphBreaks())
    window_stats = (start.stats if start else (0, 0, 0, 0), end.stats if end else (0, 0, 0, 0))
    transfers = _transfers(STATS, window_stats, window_steps)
    if STATS.ops and not any(e.calls for e in ran):
        notes.append(f"{STATS.ops} op(s) reached the tpu device but no program ran them: fused execution defers ops "
                     "until a value is needed (.item(), a print, a copy to the CPU), and the script read none back")
    if STATS.fallbacks:
        notes.append(f"{sum(STATS.fallbacks.values())} op call(s) fell back to the CPU: "
                     + ", ".join(f"{op} x{n}" for op, n in STATS.fallbacks.most_common(5)))
    if device is not None and s.devices > 1 and device.platform == "cpu":
        notes.append(f"{device.count} simulated CPU devices share this machine's cores; the peak is the whole CPU's")

    mode_used = _mode_used(ran, d.markers)
    if s.mode == "compiled-if-available" and mode_used != "compiled" and any("torch.tpu.compile is available" in n
                                                                              for n in notes):
        notes.append("nothing was compiled: the script calls neither torch.compile nor torch.tpu.compile on its "
                     "step or model, so it ran fused")
    status = "stopped" if d.stopped else ("failed" if exit_code != 0 else "complete")
    if d.stopped:
        exit_code = 0
    environment = _guarded(notes, "the environment", run.environment, None) if run.environment else None
    if refused and hlo_dir is not None and not any(e.hlo_file for e in exe_rows):
        try:  # no HLO file written: no empty folder left looking like one
            hlo_dir.rmdir()
        except OSError:
            pass
    return Profile(
        status=status, exit_code=exit_code, error=error, created_at=datetime.now(timezone.utc),
        script=os.path.abspath(run.script), args=list(run.args), cwd=os.getcwd(),
        run_dir=str(run.run_dir), settings=s, mode_used=mode_used,
        environment=environment, device=device, steps=steps_section, flops=flops, host_device=host_device,
        memory=memory, warmup=warm,
        parameters=sum(trained.values()) if trained else None,
        executables=sorted(exe_rows, key=lambda r: -(r.flops * r.calls_per_step)),
        hot_ops=hot, padding=pad, recompilations=recompiles, recompiling=recompiling, graph_breaks=breaks, transfers=transfers,
        fallbacks=dict(STATS.fallbacks), device_ops=STATS.ops, target=target,
        files=Files(hlo_dir=str(hlo_dir) if hlo_dir and (not refused or any(e.hlo_file for e in exe_rows)) else None,
                    xla_dump_dir=str(run.run_dir / "xla_dump") if s.xla_dump else None,
                    trace_dir=d.trace_dir, refused=refused),
        notes=notes,
    )


def _host_device_notes(steps, s, split, whole_run: bool) -> list[str]:
    """Which steps the host/device split used, and why there is none when there is none."""
    timed = [st.index for st in steps if st.instrumented and st.device_s is not None]
    out = []
    if timed:
        where = (f"they ran after the {s.steps} measured step(s)" if s.steps is not None else
                 "without --steps the end is not known, so they are the first after warm-up")
        out.append(f"{_ranges(timed)} waited for every executable launch, to split host and device time, and are "
                   f"left out of the statistics; {where}")
    if split is None and not whole_run and any(not st.warmup for st in steps):
        if any(st.device_s is not None for st in steps):
            out.append("host/device split not measured: every step with timed launches compiled something")
        elif s.host_device_steps > 0 or s.time_executables:
            out.append("host/device split not measured: the script ended before the steps that time launches")
    return out


def _live_growth(steps) -> str | None:
    """A note when live device memory grows step after step (something keeps each step's buffers)."""
    live = [st.live_bytes for st in steps if not st.warmup and st.live_bytes is not None]
    if len(live) < 3:
        return None
    per_step = (live[-1] - live[0]) / (len(live) - 1)
    rising = sum(b > a for a, b in zip(live, live[1:])) / (len(live) - 1)
    if per_step > max(1 << 20, 0.01 * live[0]) and rising >= 0.8:
        return (f"live device buffers grew by {per_step / (1 << 20):.1f} MiB per measured step "
                f"({live[0] / (1 << 20):.0f} to {live[-1] / (1 << 20):.0f} MiB): buffers outlive their step")
    return None


def _ranges(indices: list[int]) -> str:
    out, start, prev = [], None, None
    for i in indices:
        if start is None:
            start = prev = i
        elif i == prev + 1:
            prev = i
        else:
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = i
    if start is not None:
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
    return "steps " + ", ".join(out)


def _device(local: bool = False) -> Device:
    """The process's JAX devices; `local`: its own alone (a rank of several: jax.devices() lists every rank's)."""
    import jax

    from tpu_agent.backend.core.generations import current_generation

    devices = jax.local_devices() if local else jax.devices()
    platform = devices[0].platform
    if platform == "tpu":
        gen = peaks.tpu_generation(devices[0].device_kind)
        return Device(platform=platform, device_kind=devices[0].device_kind, count=len(devices),
                      generation=gen.name if gen else None, emulated=False)
    return Device(platform=platform, device_kind=devices[0].device_kind, count=len(devices),
                  generation=current_generation().name, emulated=True)


def _mode_used(ran, markers: list[str]) -> str:
    from tpu_agent.backend.core import modes

    # A compiled step replays its graph (kind "fused") and marks its own steps; a compiled module is "compiled".
    if "compiled_step" in markers or any(e.kind == "compiled" for e in ran):
        return "compiled"
    return "fused" if modes.fused() else "eager"


def _recompilations(recorder, d, warmup: int, ran) -> list[Recompilation]:
    rows = []
    for r, step in zip(recorder.recompiles, d.recompile_steps):
        reason = ("input shapes changed" if r.changed_shapes else
                  "a new graph with the same input shapes (the ops or their constant arguments differ, "
                  "e.g. an integer index baked into the program)")
        rows.append(Recompilation(step=step, executable=r.graph, kind="fused", shapes=r.changed_shapes,
                                  reason=reason, compile_s=r.compile_time_s))
    for exe in ran:
        step = d.registered_steps.get(exe.id)
        if exe.kind == "fused" or step is None or step <= max(warmup, 1):
            continue
        shapes = [f"{getattr(a, 'dtype', '')}{list(getattr(a, 'shape', ()))}" for a in exe.args if hasattr(a, "shape")]
        rows.append(Recompilation(step=step, executable=exe.name, kind=exe.kind, shapes=shapes,
                                  reason="first compiled after warm-up (a new op signature)"))
    return rows


def _recompiling(d, run, warmup: int, ran):
    dims = shapes.batch_dims(d.batches) if d.batches is not None else []
    progs = shapes.programs(ran, d.registered_steps, warmup)
    return shapes.diagnose(d.steps, warmup, dims, progs, shapes.sources(run.script, d.batches, d.transfers),
                           shapes.bounds(run.script))


def _graph_breaks(recorder, d, start, end, steps: int) -> GraphBreaks:
    found = recorder.breaks
    steps_of = d.break_steps + [None] * (len(found) - len(d.break_steps))
    sites: dict[tuple, GraphBreakSite] = {}
    for b, step in zip(found, steps_of):
        site = sites.get((b.op, b.reason, b.source))
        if site is None:
            site = sites[(b.op, b.reason, b.source)] = GraphBreakSite(op=b.op, reason=b.reason, source=b.source,
                                                                       count=0, first_step=step)
        site.count += 1
    lo = start.breaks if start else 0
    hi = end.breaks if end else len(found)
    return GraphBreaks(count=len(found), per_step=(hi - lo) / steps if steps else 0.0,
                       sites=sorted(sites.values(), key=lambda s: -s.count))


def _transfers(stats, window, steps: int) -> Transfers:
    (h0, hb0, d0, db0), (h1, hb1, d1, db1) = window
    n = steps or 1
    return Transfers(
        h2d_count=stats.h2d_count, h2d_bytes=stats.h2d_bytes, d2h_count=stats.d2h_count, d2h_bytes=stats.d2h_bytes,
        h2d_count_per_step=(h1 - h0) / n, h2d_bytes_per_step=(hb1 - hb0) / n,
        d2h_count_per_step=(d1 - d0) / n, d2h_bytes_per_step=(db1 - db0) / n,
    )
