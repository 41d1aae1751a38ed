"""`tpu-agent diff` on distributed profiles: the per-rank figures (`profile.json`'s `distributed`) side by side.

Shown, not gated: the job's step time and peak memory already gate in diff's main table (rank 0's profile);
these rows say where a change in them comes from (a rank, a collective, the share in communication). When one
side is distributed and the other is not, it says so and compares nothing per rank.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import ValidationError

from tpu_agent.cli.format import ms, size
from tpu_agent.profilers.schema import Distributed


def load_distributed(path: Path) -> Distributed | None:
    """The `distributed` section of a profile.json (or a run directory's); None for a single-process profile or
    a report.json. The file was read already by diff's summary: errors here are not the user's to see twice."""
    path = Path(path)
    if path.is_dir():
        found = [path / n for n in ("report.json", "profile.json") if (path / n).is_file()]
        if not found:
            return None
        path = found[0]
    try:
        data = json.loads(path.read_text())
        raw = data.get("distributed") if isinstance(data, dict) else None
        return Distributed.model_validate(raw) if raw is not None else None
    except (OSError, ValueError, ValidationError):
        return None


def _pct(x: float | None) -> str:
    return f"{x * 100:.1f} %" if x is not None else "n/a"


def _row(label: str, b, h, fmt, *, points: bool = False, lower_is_better: bool | None = True) -> str:
    change, verdict = "n/a", ""
    if b is not None and h is not None:
        if points:
            change = f"{(h - b) * 100:+.2f} pp"
            delta = h - b
        elif b:
            change = f"{h / b - 1:+.1%}"
            delta = h / b - 1
        else:
            delta = None
        if delta and lower_is_better is not None:
            verdict = "worse" if (delta > 0) == lower_is_better else "better"
    return f"| {label} | {fmt(b) if b is not None else 'n/a'} | {fmt(h) if h is not None else 'n/a'} | {change} | {verdict} |"


def _comm_bytes(d: Distributed, rank: int) -> float | None:
    entry = next((r for r in d.ranks if r.rank == rank), None)
    return sum(c.bytes_per_step for c in entry.collectives) if entry is not None else None


def _largest(d: Distributed, field: str) -> int | None:
    peaks = [getattr(r, field) for r in d.ranks if getattr(r, field) is not None]
    return max(peaks) if peaks else None


def _comm_time(d: Distributed) -> float | None:
    times = [r.comm_s_per_step for r in d.ranks if r.comm_s_per_step is not None]
    return sum(times) / len(times) if times else None


def markdown(base: Distributed | None, head: Distributed | None) -> str:
    """The distributed section of diff's output; '' when neither side is distributed."""
    if base is None and head is None:
        return ""
    lines = ["", "#### Distributed runs", ""]
    if base is None or head is None:
        which, other = ("base", "head") if base is not None else ("head", "base")
        d = base if base is not None else head
        lines.append(f"**Only the {which} is a distributed run** ({d.world_size} ranks); the {other} is a single "
                     f"process (or a report without per-rank figures): no per-rank comparison. The table above "
                     f"compares the {which}'s rank {d.ranks[0].rank if d.ranks else 0} with the {other}.")
        return "\n".join(lines) + "\n"
    lines += ["| metric | base | head | change | |", "|---|---:|---:|---:|---|",
              f"| ranks | {base.world_size} | {head.world_size} | | |",
              _row("job step time (slowest rank's median)", base.step_time_s, head.step_time_s, ms),
              _row("communication share (mean over ranks)", base.comm_share, head.comm_share, _pct, points=True),
              _row("time in collectives / step (mean over ranks)", _comm_time(base), _comm_time(head), ms),
              _row("collective bytes / step (rank 0)", _comm_bytes(base, 0), _comm_bytes(head, 0), size,
                   lower_is_better=None),
              _row("live memory peak (largest rank)", _largest(base, "live_peak_bytes"),
                   _largest(head, "live_peak_bytes"), size),
              _row("in-step memory peak (largest rank)", _largest(base, "step_peak_bytes"),
                   _largest(head, "step_peak_bytes"), size)]
    slow_b, slow_h = base.slowest_rank, head.slowest_rank
    lines.append(f"| slowest rank | {f'rank {slow_b.rank}' if slow_b else 'n/a'} | "
                 f"{f'rank {slow_h.rank}' if slow_h else 'n/a'} | | "
                 f"{'changed' if slow_b and slow_h and slow_b.rank != slow_h.rank else ''} |")
    heads = {r.rank: r for r in head.ranks}
    for b in base.ranks:
        h = heads.get(b.rank)
        if h is None:
            continue
        lines.append(_row(f"rank {b.rank}: step time (median)", b.step_time.median_s if b.step_time else None,
                          h.step_time.median_s if h.step_time else None, ms))
        lines.append(_row(f"rank {b.rank}: communication share", b.comm_share, h.comm_share, _pct, points=True))
        lines.append(_row(f"rank {b.rank}: live memory peak", b.live_peak_bytes, h.live_peak_bytes, size))
        lines.append(_row(f"rank {b.rank}: in-step memory peak", b.step_peak_bytes, h.step_peak_bytes, size))
    b0 = next((r for r in base.ranks if r.rank == 0), None)
    h0 = heads.get(0)
    if b0 is not None and h0 is not None:
        ops_b = {(c.op, tuple(c.ranks)): c for c in b0.collectives}
        ops_h = {(c.op, tuple(c.ranks)): c for c in h0.collectives}
        for key in sorted(set(ops_b) | set(ops_h)):
            cb, ch = ops_b.get(key), ops_h.get(key)
            name = f"rank 0: {key[0]} over {','.join(map(str, key[1]))}"
            lines.append(_row(f"{name}: bytes / step", cb.bytes_per_step if cb else None,
                              ch.bytes_per_step if ch else None, size, lower_is_better=None))
            lines.append(_row(f"{name}: time / step", cb.time_per_step_s if cb else None,
                              ch.time_per_step_s if ch else None, ms))
    lines.append("")
    lines.append("Per-rank figures are shown, not gated (measured; collectives timed on each rank from issue to "
                 "completion, waiting for the other ranks included).")
    for name, d in (("base", base), ("head", head)):
        if len(d.ranks) < d.world_size:
            lines.append(f"The {name} holds {len(d.ranks)} of its {d.world_size} ranks' figures (a rank's own "
                         "profile, or ranks that wrote none): its job-wide rows cover those alone.")
    if base.world_size != head.world_size:
        lines.append(f"Different world sizes ({base.world_size} vs {head.world_size}): per-rank figures compare poorly.")
    return "\n".join(lines) + "\n"
