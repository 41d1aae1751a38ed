"""The search phase: round after round, the proposer's candidates (those in the search's classes) make the space
an Optuna study searches, each round with its share of --trials; later rounds see the trials before them."""

from __future__ import annotations

from collections import Counter
from typing import Protocol

from rich.console import Console

from tpu_agent.measure.context import Measuring
from tpu_agent.measure.noop import no_change
from tpu_agent.propose.base import ProposalRound, Proposer
from tpu_agent.propose.playbook import load_playbooks
from tpu_agent.propose.scope import candidates_in_scope
from tpu_agent.search.progress import TrialProgress
from tpu_agent.search.records import TrialRecord
from tpu_agent.search.space import Space, build_space
from tpu_agent.search import workers
from tpu_agent.search.loop import search


class Watcher(Protocol):
    """Who records and says what the search does (report.progress.TuneProgress)."""
    console: Console

    def round(self, number: int, round_: ProposalRound, out_of_scope: list[str], space: Space,
              budget: int) -> None: ...

    def trial(self, record: TrialRecord) -> None: ...

    def script_failure(self, failure: tuple[int, str] | None) -> None: ...


def without_no_ops(space: Space, profile, said: set[str]) -> list[str]:
    """Leave out of the space every option that changes nothing in the baseline's run (measure.noop), so that no
    trial is spent on one; a candidate with no option left goes too. The lines to say, each once."""
    lines = []
    for cand in list(space.candidates):
        kept = []
        for option in space.options[cand.id]:
            real = tuple(a for a in option if no_change(a, profile) is None)
            for action in option:
                why = no_change(action, profile)
                if why is not None and action.describe() not in said:
                    said.add(action.describe())
                    lines.append(f"no change: {action.describe()}: {why} (not searched)")
            if real and real not in kept:
                kept.append(real)
        if kept:
            space.options[cand.id] = kept
        else:
            space.candidates.remove(cand)
            del space.options[cand.id]
    return lines


def search_rounds(study, measuring: Measuring, proposer: Proposer, knobs: list, watcher: Watcher, *,
                  done: int = 0) -> None:
    """`done`: trials an earlier run of the study recorded (the progress bar counts them; the proposer sees only
    this run's, so a resumed study keeps its search space)."""
    runner, options, profile = measuring.runner, measuring.options, measuring.profile
    playbooks, space, this_run = load_playbooks(options.playbooks), Space(candidates=[]), []
    said: set[str] = set()
    runner.fresh_baselines = profile.recompiling is not None  # each trial's baseline sees the batches anew
    bar = TrialProgress(watcher.console, options.trials, done=done)

    def on_trial(record: TrialRecord) -> None:
        watcher.script_failure(runner.script_failure)
        watcher.trial(record)
        this_run.append(record)
        bar.advance()

    workers.rounds_open(study, True)  # joined workers wait for the next round, not stop
    try:
        for number in range(1, options.rounds + 1):
            round_ = proposer.propose(profile, knobs, playbooks, [r.outcome() for r in this_run], number)
            round_, out_of_scope = candidates_in_scope(round_, options.allow)
            space = build_space(round_, options.candidates, space)
            out_of_scope += without_no_ops(space, profile, said)  # said, and listed in report.md as not searched
            budget = options.trials * number // options.rounds
            watcher.round(number, round_, out_of_scope, space, budget)
            if not space.candidates:
                return
            with bar:
                search(study, space, measuring.with_budget(budget), on_trial=on_trial,
                       on_note=lambda line: watcher.console.print(line, markup=False))
    finally:
        workers.rounds_open(study, False)
    hosts = Counter(r.host for r in this_run if r.host)
    if options.workers > 1 or len(hosts) > 1:  # other workers' trials are in this_run too: where each ran
        watcher.console.print("trials by host: " + ", ".join(f"{h} {n}" for h, n in hosts.most_common()),
                              markup=False)
