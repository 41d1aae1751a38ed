"""report.md's section for `tune --target SLICE`: the plans ranked by projection, every figure labelled
"projected for <slice>", the chosen plan called projected (never verified: only measurements verify)."""

from __future__ import annotations

from tpu_agent.projection.rank import ProjectedPlan, SliceRanking, fit_text, mfu_text, size_text

SHOWN = 12  # rows of the ranking table


def _ms(t: float | None) -> str:
    return "-" if t is None else f"{t * 1e3:.4g} ms"


def _memory(p: ProjectedPlan) -> str:
    if p.memory_per_chip_bytes is None:
        return "-"
    return f"{size_text(p.memory_per_chip_bytes)} of {size_text(p.hbm_bytes)} ({fit_text(p)})"


def _mfu(p: ProjectedPlan | None) -> str:
    return mfu_text(p.mfu if p is not None else None)


def section(r: SliceRanking) -> list[str]:
    """The markdown lines of the section."""
    label = r.label
    after = r.after
    lines = ["", f"### Plans for {r.slice} ranked by projection ({label}; estimates, not verified)", ""]
    if after is not None:
        lines += [f"**Best projected plan** ({label}; not verified, no TPU ran): {after.plan.describe()}.", ""]
    else:
        lines += [f"**No projected plan fits in HBM per chip** ({label}).", ""]
    lines += [f"| {label} | before: the script as written | after: the best projected plan |", "|---|---|---|",
              f"| plan | {r.before.plan.describe()} | {after.plan.describe() if after else '-'} |",
              f"| MFU ({label}) | {_mfu(r.before)} | {_mfu(after)} |",
              f"| step time ({label}) | {_ms(r.before.step_s)} | {_ms(after.step_s if after else None)} |",
              f"| global batch | {r.before.global_batch or 'unknown'} | {after.global_batch if after else '-'} |",
              f"| step time per sample ({label}) | {_ms(r.before.time_per_sample_s)} | "
              f"{_ms(after.time_per_sample_s if after else None)} |",
              f"| memory per chip ({label}) | {_memory(r.before)} | {_memory(after) if after else '-'} |"]
    lines += ["", f"Ranked by projected step time per sample among the plans that fit in HBM per chip (a plan that "
                  f"does not fit is never chosen). {r.projections} of {r.candidates} plans projected "
                  f"({r.meshes} mesh shapes data x fsdp x tensor the chip count and the model's dims allow, per-chip "
                  f"batches, checkpointing on or off), best first from FSDP over every chip, in {r.seconds:.0f} s "
                  "(measured). The plan is an estimate: run it on the slice to measure it "
                  "(`tpu-agent project SCRIPT --target " + f"{r.slice} --mesh ...` shows its projection in full).", "",
              f"| # | plan | step time ({label}) | per sample | MFU | memory per chip | note |",
              "|---|---|---|---|---|---|---|"]
    for i, p in enumerate(r.ranked[:SHOWN], 1):
        lines.append(f"| {i} | {p.plan.describe()} | {_ms(p.step_s)} | {_ms(p.time_per_sample_s)} | {_mfu(p)} | "
                     f"{_memory(p)} | {p.error or ''} |")
    if len(r.ranked) > SHOWN:
        lines.append(f"| | {len(r.ranked) - SHOWN} more in report.json | | | | | |")
    lines += [f"- note: {note}" for note in r.notes]
    return lines


def console_line(r: SliceRanking) -> str:
    """One line for the end of the tune."""
    if r.after is None:
        return f"{label_of(r)}: no plan projected fits in HBM per chip ({r.projections} projected)"
    return (f"{label_of(r)} (not verified): {r.after.plan.describe()}: MFU {_mfu(r.before)} as written -> "
            f"{_mfu(r.after)}, {size_text(r.after.memory_per_chip_bytes)} per chip ({r.projections} of {r.candidates} "
            "plans projected)")


def label_of(r: SliceRanking) -> str:
    return f"best plan {r.label}"
