"""The step-time plot (PNG) saved beside profile.json."""

from __future__ import annotations

from pathlib import Path

from .schema import Profile


def step_plot(profile: Profile, path: Path) -> Path | None:
    """Wall time per step, warm-up, compiling and instrumented steps marked; None if no steps."""
    steps = profile.steps.items
    if not steps:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4), dpi=100)
    groups = [
        ("steady", lambda s: not (s.warmup or s.compiled or s.instrumented), "tab:blue"),
        ("warm-up", lambda s: s.warmup, "tab:gray"),
        ("compiled", lambda s: s.compiled and not s.warmup, "tab:orange"),
        ("FlopCounterMode", lambda s: s.instrumented and not s.warmup and not s.compiled, "tab:purple"),
    ]
    for label, keep, color in groups:
        chosen = [s for s in steps if keep(s)]
        if chosen:
            ax.bar([s.index for s in chosen], [s.wall_s * 1e3 for s in chosen], color=color, label=label)
    stats = profile.steps.stats
    if stats is not None:
        ax.axhline(stats.median_s * 1e3, color="black", linewidth=1, linestyle="--",
                   label=f"median {stats.median_s * 1e3:.2f} ms")
    if any(s.wall_s > 0 for s in steps) and max(s.wall_s for s in steps) > 20 * (stats.median_s if stats else 1):
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("wall time (ms, device synchronized)")
    ax.set_title(f"{Path(profile.script).name}: step times ({profile.mode_used})")
    ax.legend(fontsize="small")
    fig.tight_layout()
    tmp = Path(path).with_name(f".{Path(path).name}.tmp")
    try:  # whole or not at all: a full disk leaves no half image behind
        fig.savefig(tmp, format="png")
        tmp.replace(path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        plt.close(fig)
    return path
