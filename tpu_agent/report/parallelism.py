"""The tune's lines and report.md section for the parallelism plans it measured: memory per rank (measured here),
time on this host (measured, never a TPU's), and with `--target SLICE` the projection that ranks them (estimates)."""

from __future__ import annotations

from tpu_agent.parallelism.measured import MeasuredParallelism, MeasuredPlan
from tpu_agent.projection.rank import mfu_text, size_text


def _which(row: MeasuredPlan) -> str:
    return f"trial {row.trial}" if row.trial is not None else "alone"


def _here(row: MeasuredPlan) -> str:
    return f"{row.speedup_here:.3f}x" if row.speedup_here is not None else "-"


def _step(row: MeasuredPlan) -> str:
    p = row.projected
    if p is None:
        return "-"
    if p.error is not None:
        return f"failed: {p.error[:80]}"
    return f"{p.step_s * 1e3:.4g} ms" if p.step_s is not None else "-"


def _per_sample(row: MeasuredPlan) -> str:
    p = row.projected
    return f"{p.time_per_sample_s * 1e3:.4g} ms" if p is not None and p.time_per_sample_s is not None else "-"


def _chip_memory(row: MeasuredPlan) -> str:
    p = row.projected
    if p is None or p.memory_per_chip_bytes is None:
        return "-"
    return f"{size_text(p.memory_per_chip_bytes)} ({'fits' if p.fits else 'does not fit'})"


def console_lines(m: MeasuredParallelism) -> list[str]:
    """One line per plan: what it does to memory per rank (measured), its time here (measured, this host's), its
    projection for the slice (estimate)."""
    head = (f"parallelism changes measured at {m.world_size} ranks on {m.host}: memory per rank is each rank's "
            "in-step peak (measured); times are this host's (measured), not a TPU slice's")
    if m.slice:
        head += f"; ranked for {m.slice} by projection ({m.label}, estimates, not verified)"
    lines = [head]
    for i, row in enumerate(m.plans, 1):
        line = (f"  {i}. {_which(row)} ({' + '.join(row.plan.effects())}): {row.plan.describe()}: memory per "
                f"rank, measured: {row.memory_text()}"
                + (f"; speed here {_here(row)} (measured, this host)" if row.speedup_here is not None else ""))
        if m.slice:
            p = row.projected
            line += (f"; {m.label}: step {_step(row)}, MFU {mfu_text(p.mfu if p else None)}, "
                     f"{_chip_memory(row)} per chip (estimate)")
        lines.append(line + (f" [{row.note}]" if row.note else ""))
    return lines


def section(m: MeasuredParallelism) -> list[str]:
    """report.md's lines."""
    title = ("### Parallelism changes: memory per rank and time measured here" +
             (f", ranked for {m.slice} by projection" if m.slice else ""))
    lines = ["", title, "",
             f"Measured at {m.world_size} ranks on {m.host}. Memory per rank is each rank's in-step peak device "
             "memory (the most bytes alive inside a step, measured), plan against baseline, medians over the trial's "
             "pairs; a row measured \"alone\" is one parallelism action by itself against the baseline (2 pairs "
             "after the search, for memory: its speed is not reported), a trial's row is its whole plan's. The speed "
             "column is the search's median ratio on this host: another mesh, resharding or "
             "checkpointing costs something else on a TPU slice's interconnect and chips, so it is measured and "
             "said to be this host's, never claimed for a TPU."]
    if m.slice:
        lines += ["", f"Ranked by the projection for {m.slice} ({m.label}; estimates, not verified: no TPU ran): "
                      "fitting plans by projected step time per sample. Each plan keeps its tensor-parallel degree; "
                      "FSDP spans the slice's other chips."]
    header = "| # | measured in | change | class | memory per rank (measured) | speed here (measured, this host) |"
    rule = "|---|---|---|---|---|---|"
    if m.slice:
        header += f" step time ({m.label}) | per sample | MFU | memory per chip |"
        rule += "---|---|---|---|"
    lines += ["", header + " note |", rule + "---|"]
    for i, row in enumerate(m.plans, 1):
        cells = [str(i), _which(row), row.plan.describe(), " + ".join(row.plan.effects()), row.memory_text(),
                 _here(row)]
        if m.slice:
            p = row.projected
            cells += [_step(row), _per_sample(row), mfu_text(p.mfu if p else None), _chip_memory(row)]
        lines.append("| " + " | ".join([*cells, row.note or ""]) + " |")
    lines += [f"- note: {note}" for note in m.notes]
    return lines
