"""The search's progress on a terminal: trials done of the total, the time elapsed and an estimate of what is
left. Piped output (a log, CI) gets none of it, only the trial lines; `--json` keeps it off stdout (the
console is then stderr's)."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class TrialProgress:
    """A rich progress bar under the trial lines while the search runs; `advance()` after each trial."""

    def __init__(self, console: Console, total: int, done: int = 0) -> None:
        self.console, self.total, self.done = console, total, done
        self.progress: Progress | None = None
        self.task = None

    def __enter__(self) -> TrialProgress:
        if self.console.is_terminal:
            # Trials take seconds to minutes: the remaining time is estimated over the last 10 minutes of them.
            self.progress = Progress(TextColumn("search"), BarColumn(), MofNCompleteColumn(), TextColumn("trials"),
                                     TimeElapsedColumn(), TextColumn("elapsed, ETA (estimate)"),
                                     TimeRemainingColumn(), console=self.console, speed_estimate_period=600,
                                     transient=True)
            self.task = self.progress.add_task("search", total=self.total, completed=min(self.done, self.total))
            self.progress.start()
        return self

    def advance(self) -> None:
        self.done += 1
        if self.progress is not None:
            self.progress.update(self.task, completed=min(self.done, self.total))
            self.progress.refresh()  # drawn now, not at the next timer tick: a quick trial could skip a count

    def __exit__(self, *exc) -> bool:
        if self.progress is not None:
            self.progress.stop()
        return False
