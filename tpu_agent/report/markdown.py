"""The tune's deliverables: report.md (for a pull request), report.json, patch.diff, plan.json, plots.

Every figure in report.md is either measured (with its interval and pair
count) or labelled an estimate; a change is listed as accepted only with a
verification behind it.
"""

from __future__ import annotations

from pathlib import Path

from tpu_agent.paths import CannotWrite, save_figure, shown_path, write_atomic
from tpu_agent.plan.actions import PadDim
from tpu_agent.report.effects import effect_lines
from tpu_agent.report.result import TuneResult, target_split
from tpu_agent.verify.verdict import Verdict


def write_all(result: TuneResult, script: Path) -> dict[str, Path]:
    """The deliverables; one the environment refuses (a full disk) is the policy's one line, which says where what
    was measured is kept (tune.json, written before, and the study)."""
    try:
        return _write_all(result, script)
    except CannotWrite as exc:
        kept = shown_path(Path(result.run_dir) / "tune.json")
        raise CannotWrite(f"{exc}; every trial and verdict measured is kept in {kept} and study "
                          f"{result.study!r}") from None


def _write_all(result: TuneResult, script: Path) -> dict[str, Path]:
    run_dir = Path(result.run_dir)
    out = {"report.json": run_dir / "report.json", "report.md": run_dir / "report.md"}
    write_atomic(out["report.json"], result.model_dump_json(indent=2) + "\n", "the report")
    if result.best is not None:
        plan_path = run_dir / "plan.json"
        result.best.plan.save(plan_path)
        out["plan.json"] = plan_path
        from tpu_agent.plan.rewrite import write_source_patch

        patch = write_source_patch(result.best.plan, script, run_dir / "patch.diff")  # literals, padding calls
        if patch is not None:
            out["patch.diff"] = patch
    out.update(_plots(result, run_dir))
    write_atomic(out["report.md"], markdown(result, out), "the report")
    return out


def _fmt_speed(verdict: Verdict) -> str:
    return verdict.speed.text() if verdict.speed else "-"


def markdown(result: TuneResult, files: dict[str, Path]) -> str:
    lines = [f"## tpu-agent: {Path(result.script).name}", ""]
    if result.host:  # the first thing a reader needs: where the gains were measured
        lines += [f"*Measured on:* {result.host}.", ""]
    split = target_split(result)
    if split:
        lines += [f"*Measured here, estimated for {result.settings.slice or result.settings.target}:* {split}.", ""]
    best = result.best
    if best is not None:
        s = best.speed
        base_s, cand_s = (s.baseline_median_s, s.candidate_median_s) if s else (0.0, 0.0)
        lines += [
            f"**Verified change** ({' + '.join(best.plan.effects())}): {best.plan.describe()}",
            "",
            "What it does to the model:",
            "",
            *[f"- {line}" for line in effect_lines(best.plan, result.parameters, result.trials)],
            "",
            "| | baseline | with the change |",
            "|---|---|---|",
            f"| median step time{' per sample' if s and s.per_sample else ''} | "
            f"{base_s * 1e3:.2f} ms | {cand_s * 1e3:.2f} ms |",
            f"| speedup (median of paired ratios) | 1.000x | {_fmt_speed(best)} |",
        ]
        if best.memory:
            m = best.memory
            change = (f"{m.saving:.1%} saved, 95% CI {m.ci_low:.1%} to {m.ci_high:.1%}" if m.saving > 0
                      else f"{-m.saving:.1%} more")
            lines.append(f"| device memory per device (measured) | {m.baseline_median_bytes / 2**20:.1f} MiB | "
                         f"{m.candidate_median_bytes / 2**20:.1f} MiB ({change}) |")
        if best.rank_memory:
            from tpu_agent.parallelism.measured import per_rank_text

            lines.append(f"| device memory per rank (in-step peak, measured) | {per_rank_text(best.rank_memory, 0)} "
                         f"| {per_rank_text(best.rank_memory)} |")
        if best.estimate_note:
            lines += ["", f"*Time:* {best.estimate_note}."]
        if result.parallelism is not None and result.parallelism.slice:
            from tpu_agent.parallelism.measured import is_parallelism

            if is_parallelism(best.plan):
                lines += ["", f"*Not a TPU speedup:* measured on {result.parallelism.host}; for "
                          f"{result.parallelism.slice} the parallelism changes are ranked by projection below "
                          "(estimates, not verified)."]
        for note in best.left_out:
            lines += ["", f"*Left out of the search's best plan:* {note}."]
        if best.attribution:
            lines += ["", "**Where the gain comes from** (each unit of changes against the verified plan without "
                      "it, fresh processes, interleaved pairs; a unit that is not exact stays only for a gain of its "
                      "own that clears the minimum gain):", "",
                      "| changes | compared with | speedup they add |", "|---|---|---|"]
            for a in best.attribution:
                lines.append(f"| {a.unit}: {a.actions} | {a.without or '(no change)'} | "
                             f"{a.speed.text() if a.speed else a.reason} |")
        if best.numerics:
            lines += ["", f"**Numerics:** {best.numerics.reason}"]
        if result.baseline_mode and result.baseline_mode != "compiled":
            lines += ["", f"*Baseline:* the script as written, which ran in {result.baseline_mode} execution. That is "
                      "not the fastest execution that needs no change to the model: fused and compiled execution "
                      "(no change to the script; the same math in another order, so class numerics) are searched "
                      "and credited like the others (see where the gain comes from)."]
        lines += ["", f"Measured on {_measured_on(result)}: "
                      f"baseline and candidate ran in {result.settings.verify_rounds} fresh process pairs (the "
                      f"interval, a two-level bootstrap, counts the spread between them), steps interleaved "
                      f"(A B A B ...) after "
                      f"{result.settings.warmup} warm-up steps each, device synchronized around every step; "
                      f"accepted only if the interval's lower end clears {1 + result.settings.min_gain:.2f}x."]
        if "patch.diff" in files:
            lines += ["", "Apply the source change with `git apply patch.diff` (or `tpu-agent tune --apply`)."]
        from tpu_agent.plan.batch_calls import run_time_actions

        patched = "patch.diff" in files  # the plan's source patch holds its literals and padding calls
        actions = run_time_actions(best.plan, result.script) if patched else best.plan.actions
        runtime = [line for line in (a.instruction() for a in actions) if line]
        if runtime:
            lines += ["", "Run-time changes (not in the patch; `tpu-agent run SCRIPT --plan plan.json` applies them all):"]
            lines += [f"- {line}" for line in runtime]
    else:
        lines += ["**No change was verified.** The baseline stays as it is."]
    if result.interrupted:
        lines += ["", f"*Interrupted during the {result.interrupted_during or 'search'}; the study keeps every finished "
                  "trial (`--resume` continues).*"]

    if result.script_failure:
        lines += ["", f"*Note: {result.script_failure}. Trials and verification measure the steps before it.*"]
    if result.projection is not None:
        from tpu_agent.report.projection import section

        lines += section(result.projection)
    if result.parallelism is not None:
        from tpu_agent.report import parallelism

        lines += parallelism.section(result.parallelism)
    lines += ["", "### Verification", "", "| change | result | speed | numerics |", "|---|---|---|---|"]
    for v in result.verdicts:
        num = v.numerics.reason if v.numerics else "-"
        lines.append(f"| {v.plan.describe()} | {'accepted' if v.accepted else 'rejected'}: {v.reason} | "
                     f"{_fmt_speed(v)} | {num} |")
    if not result.verdicts:
        lines.append("| - | no trial was faster than the baseline in the search | - | - |")

    lines += ["", f"### Candidates ({result.proposer} proposer)", ""]
    for c in result.candidates:
        why = "; ".join(e.what for e in c.evidence[:2])
        lines.append(f"{c.rank}. **{c.title}** ({c.proposer}"
                     f"{', playbook ' + c.playbook if c.playbook else ''}): {why}")
    for note in result.proposer_notes:
        lines.append(f"- note: {note}")
    if result.left_out:
        allow = ", ".join(result.settings.allow) or "none"
        lines += ["", f"### Not searched (classes searched: exact, numerics; --allow: {allow})", ""]
        lines += [f"- {line}" for line in result.left_out]

    lines += ["", f"### Trials (study `{result.study}`)", "",
              "| # | state | speedup in search | memory | start-up + warm-up | trial | plan | note |",
              "|---|---|---|---|---|---|---|---|"]
    for t in result.trials:
        sp = f"{t.speedup:.3f}x" if t.speedup is not None else "-"
        mem = f"{t.memory_ratio:.2f}x" if t.memory_ratio is not None else "-"
        warm = f"{t.warmup_s:.1f} s" if t.warmup_s is not None else "-"
        state = f"{t.state} (earlier run)" if t.earlier else t.state
        lines.append(f"| {t.number} | {state} | {sp} | {mem} | {warm} | {t.duration_s:.1f} s | {t.plan.describe()} "
                     f"| {t.reason[:80]} |")
    lines += ["", "Search speedups are single-trial medians against a warm baseline, for ranking only; only the "
                  "verification figures above are claims."]
    for name in ("trials.png", "gain_per_action.png"):
        if name in files:
            lines += ["", f"![{name}]({name})"]
    phases = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in result.phase_s.items() if seconds >= 0.5)
    lines += ["", f"<sub>tpu-agent, {result.duration_s / 60:.1f} min, {len(result.trials)} trials"
                  + (f" ({phases})" if phases else "") + "</sub>", ""]
    return "\n".join(lines)


def _plots(result: TuneResult, run_dir: Path) -> dict[str, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = {}
    done = [t for t in result.trials if t.speedup is not None]
    if done:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        ax.plot([t.number for t in done], [t.speedup for t in done], "o", label="trial (median ratio)")
        best = []
        for t in done:
            best.append(max(t.speedup, best[-1]) if best else t.speedup)
        ax.step([t.number for t in done], best, where="post", label="best so far")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xlabel("trial")
        ax.set_ylabel("speedup vs baseline (search)")
        ax.legend()
        fig.tight_layout()
        out["trials.png"] = save_figure(fig, run_dir / "trials.png", "the trials plot", dpi=110)
        plt.close(fig)
        by_kind: dict[str, list[float]] = {}
        for t in done:
            for a in t.plan.actions:
                by_kind.setdefault(a.kind if not isinstance(a, PadDim) else f"pad {a.name or a.old}", []).append(t.speedup)
        if by_kind:
            fig, ax = plt.subplots(figsize=(7, 3.5))
            names = sorted(by_kind)
            ax.bar(names, [sorted(v)[len(v) // 2] for v in (by_kind[n] for n in names)])
            ax.axhline(1.0, color="grey", lw=0.8)
            ax.set_ylabel("median speedup of trials with it")
            ax.tick_params(axis="x", rotation=30)
            fig.tight_layout()
            out["gain_per_action.png"] = save_figure(fig, run_dir / "gain_per_action.png", "the gains plot", dpi=110)
            plt.close(fig)
    return out


def _measured_on(result: TuneResult) -> str:
    """Where the steps ran, never --target: a v5e target on a CPU host tiles for v5e, it does not time one."""
    device = result.summary.device if result.summary is not None else None
    notes = ([f"JAX devices: {device}"] if device else []) + \
        ([f"shapes tiled for {result.settings.generation}"] if result.settings.generation != "cpu" else [])
    return "this host" + (f" ({'; '.join(notes)})" if notes else "")
