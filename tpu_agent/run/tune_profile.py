"""The tuner's profiles: the unchanged script (the baseline), and at the end the verified plan, so that
`diff` compares the two on every figure (FLOPs, MFU, XLA peak memory), not on step time alone."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tpu_agent import envvars
from tpu_agent.config import TuneOptions
from tpu_agent.errors import TpuAgentError
from tpu_agent.paths import CANNOT_WRITE_EXIT, CannotWrite, refusal_of_run, shown_path, writing
from tpu_agent.plan.actions import PadDim, Plan
from tpu_agent.profilers.schema import Profile, Settings
from tpu_agent.run.device_use import profile_touched, refusal
from tpu_agent.run.launch import READ_STDIN, READ_STDIN_MARK
from tpu_agent.run.profiled import StepWatch, gather_ranks, read_profile, refused_files, run_profiled


class BaselineFailed(TpuAgentError):
    """The unchanged script did not run (exit 1): there is nothing to tune against."""


def profile_for_tune(script: Path, args: list[str], run_dir: Path, options: TuneOptions,
                     plan: Plan | None = None) -> tuple[Profile, Path]:
    """Profile the script (with `plan` applied: its source edits on a copy) in a child process whose output
    goes to a log.

    A step (or the start-up before the first) running past `--trial-timeout` stops it; a failed baseline shows
    the script's own output (its traceback, its usage message) and stops the tune; Ctrl-C while it runs is the
    tune's KeyboardInterrupt."""
    what = "baseline" if plan is None else "plan"
    settings = Settings(steps=options.steps, warmup=options.warmup, mode="eager", devices=options.devices,
                        target=None if options.generation == "cpu" else options.generation)
    ran, env = script, {}
    if plan is not None:
        env[envvars.PLAN.name] = plan.model_dump_json()
        if plan.of(PadDim):
            from tpu_agent.plan.rewrite import apply_pad_dims

            ran = apply_pad_dims(plan, script, run_dir / "workspaces" / "profile").script
    log_path = run_dir / f"{what}-profile.log"
    if options.nproc > 1:  # the launcher passes no progress pipe on: the whole run gets the steps' time limit
        watch, limit = None, options.trial_timeout * (options.warmup + options.steps + 1) + 120.0
        launch = {"timeout": limit, "nproc": options.nproc}
    else:
        watch = StepWatch(options.trial_timeout)
        launch = {"pass_fds": (watch.write_fd,), "monitor": watch, "deadline": watch.deadline}
        env.update(watch.env())
    with writing(log_path, f"the {what}'s log"):  # a full disk: its cause in one line
        log = open(log_path, "wb")
    with log:
        result, path = run_profiled(ran, args, settings, runs_root=run_dir, stdin=subprocess.DEVNULL,
                                    stdout=log.fileno(), stderr=log.fileno(), extra_env=env, **launch)
    if options.nproc > 1:  # each rank wrote its own profile: gathered as profile --nproc gathers them
        gather_ranks(Path(result.run_dir), options.nproc, result.exit_code)
    shown = shown_path(log_path)
    if result.interrupted or (result.exit_code == 130 and not result.timed_out):
        raise KeyboardInterrupt
    if result.timed_out and watch is None:
        raise BaselineFailed(f"the {what} run of {options.nproc} ranks ran past {launch['timeout']:.0f} s "
                             f"(--trial-timeout for each of its steps and its start-up) and was stopped; its output "
                             f"is in {shown}")
    if result.timed_out:
        raise BaselineFailed(f"the {what} run timed out: no progress to {watch.waiting_for or watch.timed_out_waiting} "
                             f"within {options.trial_timeout:.0f} s (--trial-timeout); its output is in {shown}")
    if result.exit_code == CANNOT_WRITE_EXIT and not path.exists():  # the run finished; its profile was refused
        reason = refusal_of_run(result.run_dir)
        raise CannotWrite(f"cannot write the {what}'s profile {shown_path(path)}: {reason}")
    if not result.ok:
        if plan is None:
            tail = log_path.read_text(errors="replace").rstrip().splitlines()[-25:]
            if tail:  # the script's own words (its traceback, its usage message), as python would show them
                sys.stderr.write("\n".join(tail) + "\n")
                sys.stderr.flush()
        why = f"killed by signal {result.signal_number}" if result.signal_number else f"exit {result.exit_code}"
        hint = (f"; {READ_STDIN}" if READ_STDIN_MARK in log_path.read_text(errors="replace")
                else " (pass the script's own arguments after '--')" if plan is None else "")
        raise BaselineFailed(f"the {what} run of {script.name} failed ({why}); its output is in {shown}{hint}")
    try:
        profile = read_profile(path)
    except FileNotFoundError:
        raise BaselineFailed(f"the {what} run wrote no profile; its output is in {shown}") from None
    files_refused = refused_files(profile)  # its HLO files or plot: a full disk stops the tune, its cause said
    if files_refused is not None:
        raise CannotWrite(files_refused)
    if not profile_touched(profile):  # nothing to measure on the device: every trial would time the CPU
        raise BaselineFailed(f"{refusal(script.name, 'tune')}; its output is in {shown}")
    if profile.steps.whole_run:  # no step boundary: a trial has nothing to time, every one would fail
        used = (f" ({profile.device_ops} op(s) of it reached the tpu device, none inside a step)"
                if profile.device_ops else "")
        raise BaselineFailed(f"no training step was seen in {script.name}{used}: the tool times a step from one "
                             "optimizer.step() (any torch optimizer) or torch.tpu.mark_step() to the next, and the "
                             f"script called neither; its output is in {shown}")
    return profile, path
