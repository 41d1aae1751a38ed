"""Which pruner the search keeps: Optuna's median pruner or its WilcoxonPruner, on the bundled examples.

    .venv/bin/python benchmarks/pruners.py                              # mlp, 10 trials (2.6 min here)
    .venv/bin/python benchmarks/pruners.py --examples odd_shapes cnn --trials 12
    .venv/bin/python benchmarks/pruners.py --examples mlp --save rec/   # then --load rec/: replays, no measuring

Each example is searched once with pruning off, through the real Runner (warm baseline, A B A B pairs), and
every pair's arrival time is recorded. The real `search` then replays those measurements under each pruner,
the same trials in the same order (enqueued), so the pruners differ only in what they stop, not in what the
machine was doing. Per pruner: trials pruned, pruned trials that the full measurement found faster than the
baseline (mistakes), the seconds of the recorded measuring it would have spent (a trial's start-up and its
pairs up to the prune; the unpruned search's total for comparison), and the plan it would keep, verified in
fresh processes as `tune` verifies (one verification per distinct plan, shared between pruners).

What the pruners read (tpu_agent/search/study.py, `Pruner`): the pairs in which neither process compiled, and
both are asked only about a trial whose running median of those pair ratios is under 1.0 (slower than the
baseline so far), except `wilcoxon-best`. The median pruner reads that running median at pair i against earlier
trials' at pair i; WilcoxonPruner reads each pair's own ratio and tests it against the best trial's pairs, matched
by pair index.
"""

from __future__ import annotations

import argparse
import pickle
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import optuna

from tpu_agent.config import TuneOptions
from tpu_agent.measure.context import Measuring
from tpu_agent.measure.compare import MIN_STEADY, median, steady_ratios
from tpu_agent.measure.runner import Runner
from tpu_agent.measure.trials import StepRecord, TrialFailed
from tpu_agent.propose import knobs as knob_finder
from tpu_agent.propose import make_proposer
from tpu_agent.propose.playbook import load_playbooks
from tpu_agent.run.tune_profile import profile_for_tune
from tpu_agent.search.space import build_space
from tpu_agent.search.loop import search
from tpu_agent.search.study import open_study, ranked_plans
from tpu_agent.verify.verdict import verify

ROOT = Path(__file__).resolve().parent.parent
COMPARED = ("median", "wilcoxon", "wilcoxon-best")


@dataclass
class Recorded:
    """One plan's measurement: its pairs, when each pair ended (seconds from the trial's start), its end."""

    a: list[StepRecord] = field(default_factory=list)
    b: list[StepRecord] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    stamps: list[float] = field(default_factory=list)
    total_s: float = 0.0
    failed: tuple[str, str] | None = None  # (kind, message): a TrialFailed, kept in a form that pickles

    @property
    def speedup(self) -> float | None:
        """As the unpruned search measured it: pairs without compilation (all, when fewer than 3 are)."""
        steady = steady_ratios(self.a, self.b, 1.0)
        ratios = steady if len(steady) >= MIN_STEADY else [x.wall_s / y.wall_s for x, y in zip(self.a, self.b)]
        return median(ratios) if ratios else None


class RecordingRunner(Runner):
    """The real Runner, each trial's pairs and their times kept by plan."""

    def __init__(self, *args):
        super().__init__(*args)
        self.recorded: dict[str, Recorded] = {}

    def measure(self, plan, name, pairs, report=None, fresh_baseline=False):
        if not name.startswith("trial-"):
            return super().measure(plan, name, pairs, report, fresh_baseline)
        rec, t0 = Recorded(), time.perf_counter()
        self.recorded[plan.key()] = rec

        def stamped(i, a, b):
            rec.stamps.append(time.perf_counter() - t0)
            if report is not None:
                report(i, a, b)

        try:
            a, b, cand = super().measure(plan, name, pairs, stamped, fresh_baseline)
        except TrialFailed as exc:
            rec.failed, rec.total_s = (exc.kind, exc.message), time.perf_counter() - t0
            raise
        rec.a, rec.b, rec.steps, rec.notes = a, b, list(cand.steps), list(cand.notes)
        rec.total_s = time.perf_counter() - t0
        return a, b, cand


class ReplayRunner:
    """The recorded pairs, handed to the search as the Runner would hand them; the time they took is added up."""

    def __init__(self, recorded: dict[str, Recorded]):
        self.recorded, self.baseline, self.spent_s = recorded, None, 0.0

    def measure(self, plan, name, pairs, report=None, fresh_baseline=False):
        rec = self.recorded[plan.key()]
        if rec.failed is not None:
            self.spent_s += rec.total_s
            raise TrialFailed(*rec.failed)
        for i in range(len(rec.a)):
            try:
                report(i, rec.a[:i + 1], rec.b[:i + 1])
            except optuna.TrialPruned:
                self.spent_s += rec.stamps[i]
                raise
        self.spent_s += rec.total_s
        return rec.a, rec.b, type("Cand", (), {"steps": rec.steps, "notes": rec.notes})()

    def close(self):
        pass


@dataclass
class Recording:
    """One example's unpruned search, replayable: the trials' order, each plan's measurement, the verdicts."""

    example: str
    options: TuneOptions
    space: object
    batch: int | None
    order: list[dict]
    recorded: dict[str, Recorded]
    searched_s: float
    verified: dict[str, str] = field(default_factory=dict)  # plan key -> the verification's result


def record(example: str, trials: int, seed: int, work: Path):
    """The example's baseline, proposals and search with pruning off; (the recording, a verify(plan) function)."""
    script = ROOT / "examples" / f"{example}.py"
    options = TuneOptions(trials=trials, seed=seed, storage=f"sqlite:///{work / 'studies.db'}")
    run_dir = work / "run"
    run_dir.mkdir()
    t0 = time.perf_counter()
    profile, path = profile_for_tune(script, [], run_dir, options)
    knobs = knob_finder.discover(script, profile=profile, script_args=[], profile_path=str(path)).knobs
    batch_knob = next((k for k in knobs if k.batch and not k.overridden), None)
    batch = batch_knob.value if batch_knob else None
    agent = make_proposer("offline")
    space = build_space(agent.propose(profile, knobs, load_playbooks([]), [], 1), options.candidates)
    runner = RecordingRunner(script, [], options, run_dir)
    study = open_study(options, "recorded", options.fingerprint(script, []), work, pruner="none")
    try:
        search(study, space, Measuring(runner, options, batch))
    finally:
        runner.close()
    rec = Recording(example, options, space, batch, [t.params for t in study.trials], runner.recorded,
                    time.perf_counter() - t0)

    def check(plan) -> str:
        verdict = verify(plan, Measuring(runner, options, batch, profile))
        return ("accepted " if verdict.accepted else "rejected ") + (verdict.speed.text() if verdict.speed
                                                                    else verdict.reason)
    return rec, check


def replay(rec: Recording, work: Path, check=None) -> list[str]:
    """The recorded search under each pruner; the plan each keeps verified with `check` (None: as saved)."""
    full = sum(r.total_s for r in rec.recorded.values())
    lines = [f"{rec.example}: {len(rec.order)} trials, {len(rec.space.candidates)} candidates; unpruned search "
             f"{full:.1f} s of measuring ({rec.searched_s:.0f} s with the baseline profile)"]
    options = rec.options.model_copy(update={"storage": f"sqlite:///{work / 'replays.db'}"})
    for name in COMPARED:
        study = open_study(options, f"replay-{name}-{time.monotonic_ns()}", "fp", work, pruner=name)
        for params in rec.order:
            study.enqueue_trial(params)
        runner = ReplayRunner(rec.recorded)
        records = search(study, rec.space, Measuring(runner, options, rec.batch))
        pruned = [r for r in records if r.state == "pruned"]
        wrong = [r for r in pruned if (rec.recorded[r.plan.key()].speedup or 0) > 1.0]
        best = ranked_plans(study)[:1]
        if best and best[0].key() not in rec.verified and check is not None:
            rec.verified[best[0].key()] = check(best[0])
        shown = (f"{best[0].describe()}: {rec.verified.get(best[0].key(), 'not verified (a saved recording)')}"
                 if best else "no plan faster than the baseline")
        lines.append(f"  {name:13s} pruned {len(pruned):2d}/{len(records)} (of them faster than the baseline "
                     f"in full: {len(wrong)}), measuring {runner.spent_s:6.1f} s ({runner.spent_s / full:.0%}); "
                     f"kept {shown}")
        if pruned:
            lines.append("                pruned: " + ", ".join(
                f"#{r.number} " + (r.reason.split("median ")[-1] if "not run again" not in r.reason else
                                   f"(repeat of #{r.reason.split('trial ')[1].split(',')[0]}, not run)")
                + f" (in full {rec.recorded[r.plan.key()].speedup:.3f}x)" for r in pruned))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", nargs="+", default=["mlp"])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", type=Path, metavar="DIR", help="keep each recording (<example>.pkl) for --load")
    parser.add_argument("--load", type=Path, metavar="DIR", help="replay saved recordings: no measuring")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    t0 = time.perf_counter()
    for example in args.examples:
        with tempfile.TemporaryDirectory(prefix=f"pruners-{example}-") as tmp:
            if args.load:
                rec, check = pickle.loads((args.load / f"{example}.pkl").read_bytes()), None
            else:
                rec, check = record(example, args.trials, args.seed, Path(tmp))
            lines = replay(rec, Path(tmp), check)
            if args.save:
                args.save.mkdir(parents=True, exist_ok=True)
                (args.save / f"{example}.pkl").write_bytes(pickle.dumps(rec))
        for line in lines:
            print(line, flush=True)
    print(f"({time.perf_counter() - t0:.0f} s in all)")


if __name__ == "__main__":
    main()
