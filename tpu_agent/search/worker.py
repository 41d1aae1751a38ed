"""One worker of a study, in this process: `tpu-agent tune SCRIPT --storage URL --join STUDY` (pipeline.join), or a
process that `--workers N` started (`python -m tpu_agent.search.worker`, its spec on stdin). It measures the study's plans on
this host until the study holds its budget of measured plans, round after round of the tune's, and verifies
nothing."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

from tpu_agent.config import TuneOptions
from tpu_agent.search.storage import redact, storage_url
from tpu_agent.search.workers import load_space, next_round


def join(script: Path, args: list[str], options: TuneOptions, run_dir: Path, *, runner=None, say=print,
         on_trial=None, seed_offset: int = 0, rounds: bool = True, study=None) -> list:
    """One worker of the study `options.join` (`study`: opened already by study.joined_study): its trials until the study
    holds its budget of measured plans (`rounds`: then the tune's later rounds too; a worker the tune started for
    one round stops with it). `on_trial`: told each trial's record (else one line each through `say`)."""
    from tpu_agent.measure.context import Measuring
    from tpu_agent.measure.runner import Runner
    from tpu_agent.search.loop import search
    from tpu_agent.search.study import joined_study

    url = storage_url(options, options.runs_root())
    study = study or joined_study(script, args, options)
    budget = int(study.user_attrs.get("trials") or options.trials)
    say(f"worker on {socket.gethostname()}: study {options.join!r} in {redact(url)}, "
        f"{len(load_space(study).candidates)} candidates, {budget} trials in all so far")
    run_dir.mkdir(parents=True, exist_ok=True)
    runner = runner or Runner(script, args, options, run_dir)
    runner.fresh_baselines = bool(study.user_attrs.get("fresh_baselines"))

    def line(record) -> None:
        shown = f"{record.speedup:.3f}x" if record.speedup is not None else "-"
        say(f"  trial {record.number:3d} {record.state.value:9s} {shown:>8s}  {record.plan.describe()}"
            + (f"  {record.reason[:90]}" if record.reason and record.state != "complete" else ""))

    records, measuring = [], Measuring(runner, options, study.user_attrs.get("baseline_batch"))
    try:
        while budget is not None:  # round after round of the tune's, each with its space and budget
            records += search(study, load_space(study), measuring.with_budget(budget), on_trial=on_trial or line,
                              on_note=say,
                              seed_offset=seed_offset, seeded=False)
            budget = next_round(study, budget, say) if rounds else None
        return records
    finally:
        runner.close()


def main(runner=None) -> int:
    """A worker started by `--workers N`: its spec on stdin (`runner`: a measuring double, in tests)."""
    from tpu_agent import interrupts
    from tpu_agent.errors import TpuAgentError

    spec = json.loads(sys.stdin.read())
    options = TuneOptions.model_validate(spec["options"], strict=False)
    try:
        with interrupts.stop_signals_interrupt():  # the tune stopping: this worker's processes stopped too
            join(Path(spec["script"]), spec["args"], options, Path(spec["run_dir"]), seed_offset=spec["seed_offset"],
                 rounds=spec.get("rounds", False),
                 say=lambda line: print(line, flush=True), runner=runner)
    except TpuAgentError as exc:
        print(f"error: {exc}", flush=True)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted: what finished is in the study", flush=True)
        return interrupts.exit_code()
    return 0


if __name__ == "__main__":
    sys.exit(main())
