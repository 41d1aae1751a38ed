"""What `tpu-agent tune` says as it goes, one method a line (or a few): the pipeline's flow holds no markup."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape

from tpu_agent.config import TuneOptions
from tpu_agent.measure.compare import shown_bytes
from tpu_agent.profilers.schema import Profile
from tpu_agent.report.result import TuneResult
from tpu_agent.search.records import TrialRecord
from tpu_agent.search.space import Space
from tpu_agent.verify.verdict import Verdict


class TuneLines:
    def __init__(self, console: Console) -> None:
        self.console = console

    def _warn(self, text: str) -> None:
        self.console.print(f"[yellow]{escape(text)}[/yellow]")

    def proposer(self, proposer: str, why: str) -> None:
        self.console.print(f"proposer: {proposer}" + (f" ({why})" if why else ""))

    def study(self, study: str, dashboard: str) -> None:
        self.console.print(f"study {study!r}, live: {dashboard}", markup=False)

    def resuming(self, study: str, earlier: int) -> None:
        if earlier:
            self.console.print(f"resuming study {study!r}: {earlier} trial(s) recorded earlier, not run again")

    def baseline(self, script_name: str, options: TuneOptions) -> None:
        self.console.print(f"[bold]baseline[/bold]: profiling {script_name} ({options.warmup} warm-up + "
                           f"{options.steps} steps)")

    def baseline_done(self, seconds: float, profile: Profile) -> None:
        self.console.print(f"  {seconds:.1f} s, of which {profile.steps.compile_s:.1f} s compiling "
                           f"({profile.steps.compiles} programs)")

    def left_out(self, lines: list[str]) -> None:
        for line in lines:
            self.console.print(f"[dim]{escape(line)}[/dim]")

    def notes(self, notes: list[str]) -> None:
        for note in notes:
            self._warn(note)

    def script_failure(self, text: str) -> None:
        self._warn(f"{text}; the steps before it are measured")

    def nothing_to_search(self) -> None:
        self.console.print("no candidate changes for this profile: nothing to search")

    def round(self, number: int, space: Space, budget: int, trials: int, study: str) -> None:
        self.console.print(f"[bold]search[/bold] (round {number}): {len(space.candidates)} candidates, "
                           f"trials up to {budget} of {trials} (study {study!r})")
        for i, c in enumerate(space.candidates, 1):  # numbered as listed: a no-op candidate left out leaves no gap
            self.console.print(f"  {i}. {c.title} [dim]({c.proposer}, {len(space.options[c.id])} options)[/dim]")

    def trial(self, record: TrialRecord) -> None:
        shown = f"{record.speedup:.3f}x" if record.speedup is not None else "-"
        log = f" (logs/trial-{record.number}.log)" if record.state == "failed" else ""
        self.console.print(f"  trial {record.number:3d} {record.state:9s} {shown:>8s}  {record.plan.describe()}"
                           + (f"  [dim]{escape(record.reason[:90])}{log}[/dim]"
                              if record.reason and record.state != "complete" else ""))

    def verify_none(self) -> None:
        self.console.print("[bold]verify[/bold]: none (--verify 0): the trials' figures are search measurements, "
                           "not verified gains")

    def verifying(self, plan) -> None:
        self.console.print(f"[bold]verify[/bold]: {escape(plan.describe())} ({' + '.join(plan.effects())}; "
                           "fresh processes, interleaved pairs)")

    def verdict(self, verdict: Verdict) -> None:
        self.console.print(("  [green]accepted[/green]: " if verdict.accepted else "  [red]rejected[/red]: ")
                           + verdict.reason)

    def unit_added(self, a) -> None:
        """The ablation: what one unit of a verified plan adds over the rest of it (verify.ablation)."""
        self.console.print(f"  {a.unit} ({a.actions}) adds {a.speed.text() if a.speed else a.reason} over the rest "
                           "of the plan", markup=False)

    def trimming(self, smaller, without: list[str], left_out: list[str]) -> None:
        """The ablation: the units left out, and the smaller plan verified next (none left: nothing verified)."""
        for line in left_out:
            self.console.print(f"  left out: {line}", markup=False)
        if smaller.actions:
            self.console.print(f"[bold]verify[/bold]: {escape(smaller.describe())} "
                               f"(without {escape(', '.join(without))})")

    def parallelism(self, measured) -> None:
        """The parallelism plans measured (project.measured.MeasuredParallelism): memory per rank, ranked."""
        from tpu_agent.report.parallelism import console_lines

        for line in console_lines(measured):
            self.console.print(line, markup=False)

    def plan_profile(self, options: TuneOptions) -> None:
        self.console.print(f"[bold]profile[/bold]: the verified plan ({options.warmup} warm-up + {options.steps} "
                           "steps), for the report's summary")

    def plan_profile_failed(self, error: str) -> None:
        self._warn(f"the verified plan's profile failed: {error}; the summary has its verified step time only")

    def host(self, result: TuneResult) -> None:
        """Under the verdict: where its figures were measured, and what is only estimated for --target."""
        from tpu_agent.report.result import target_split

        if result.host:
            self.console.print(f"  measured on {result.host}", markup=False)
        split = target_split(result)
        if split:
            self.console.print(f"  {split}", markup=False)

    def interrupted(self, result: TuneResult) -> None:
        """The one line an interrupt (Ctrl-C, SIGTERM, SIGHUP) prints, in any phase: what was kept."""
        phase = result.interrupted_during
        by = f" by {result.interrupted_by}" if result.interrupted_by not in (None, "SIGINT") else ""
        if phase == "baseline":
            kept = "nothing was measured yet"
        elif phase == "search":
            kept = "finished trials are saved in the study; --resume continues"
        elif phase == "profile":
            phase, kept = "profile of the verified plan", "the plan stands; the summary has its verified step time only"
        else:  # the verification, or the ablation within it
            stands = f"; the verified plan stands ({result.best.plan.describe()})" if result.best else ""
            kept = (f"{len(result.verdicts)} finished verification(s) kept{stands}; the study keeps every trial, "
                    "--resume verifies again")
        self._warn(f"interrupted during the {phase}{by}: {kept}")


def ranks_lines(profile: Profile) -> list[str]:
    """What the baseline of an N-rank job measured per rank: the job's pace (the slowest rank's median step) and
    each rank's step time and peak device memory, as profile.json's `distributed` section holds them."""
    dist = profile.distributed
    if dist is None:
        return []
    pace = f"{dist.step_time_s * 1e3:.1f} ms" if dist.step_time_s is not None else "not measured"
    slowest = f", slowest rank {dist.slowest_rank.rank}" if dist.slowest_rank is not None else ""
    lines = [f"  {dist.world_size} ranks ({dist.launcher}): a step takes its slowest rank's time, {pace} "
             f"(median){slowest}; trials and verification time each step as the slowest rank's (per-step max)"]
    for entry in dist.ranks:
        step = f"{entry.step_time.median_s * 1e3:.1f} ms" if entry.step_time is not None else "-"
        peak = entry.step_peak_bytes if entry.step_peak_bytes is not None else entry.live_peak_bytes
        what = "in-step peak" if entry.step_peak_bytes is not None else "peak at a step boundary"
        memory = shown_bytes(peak) if peak is not None else "-"
        lines.append(f"  rank {entry.rank}: median step {step}, device memory {memory} ({what}, measured)")
    if dist.missing_ranks:
        lines.append(f"  ranks without a profile: {dist.missing_ranks}")
    return lines
