"""The child process of a run: `python -P -m tpu_agent.run.child SCRIPT ARGS...`.

It makes the user's script see what `python SCRIPT ARGS...` would show it
(argv, cwd, `sys.path[0]`, `__name__ == "__main__"`, its own traceback and
exit status), with torch, and so our `tpu` device, loaded first. One
difference is unavoidable with runpy: `sys.argv[0]` is the absolute path, as
`__file__` already is under plain `python`. What the parent asks for comes in
the environment (`tpu_agent.envvars`, payloads in `run.messages`): the
profiler (`TPU_AGENT_PROFILE`), a timing trial (`TPU_AGENT_TRIAL`), a
plan's run-time actions (`TPU_AGENT_PLAN`) or a device map
(`TPU_AGENT_DEVICE_MAP`, `run.device_map`), hooked in between `import torch`
and the script. A plain run that put no work on the device ends with a
warning saying so when its model trained on the CPU (`run.device_use`).
"""

from __future__ import annotations

import gc
import os
import runpy
import signal
import sys
from pathlib import Path
from types import TracebackType

from tpu_agent import envvars
from tpu_agent.errors import one_line

USAGE = "usage: python -m tpu_agent.run.child SCRIPT [ARGS...]"


def _script_traceback(tb: TracebackType | None, script: str) -> TracebackType | None:
    """Drop our frames (this module, runpy) above the script's first frame."""
    cur = tb
    while cur is not None:
        if cur.tb_frame.f_code.co_filename == script:
            return cur
        cur = cur.tb_next
    return tb  # the failure was not in the script: show everything


def _exit_status(exc: SystemExit) -> int:
    """The status python exits with for this SystemExit."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    return 1


def _prepare_process(settings, run_dir: Path) -> None:
    """Before jax starts: XLA flags (simulated devices, XLA's dump) and executable timing."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    if settings.devices > 1:  # the backend's knob, and the flag it stands for
        os.environ[envvars.DEVICES.name] = str(settings.devices)
        flags = [f for f in flags if not f.startswith("--xla_force_host_platform_device_count")]
        flags.append(f"--xla_force_host_platform_device_count={settings.devices}")
    if settings.xla_dump:
        flags += [f"--xla_dump_to={run_dir / 'xla_dump'}", "--xla_dump_hlo_as_text"]
    if flags:
        os.environ["XLA_FLAGS"] = " ".join(flags)
    if settings.time_executables:
        os.environ[envvars.TIME_EXECUTABLES.name] = "1"


def _progress_writer(fd: int):
    from tpu_agent.run.messages import Progress

    os.set_inheritable(fd, False)  # the script's own children do not get it
    state = {"fd": fd}

    def write(event: str, **fields) -> None:
        if state["fd"] is None:
            return
        try:
            os.write(state["fd"], (Progress(event=event, **fields).model_dump_json() + "\n").encode())
            if event == "done":
                os.close(state["fd"])
                state["fd"] = None
        except OSError:
            state["fd"] = None

    return write


def _import_what_the_first_op_would() -> None:
    import jax.numpy  # noqa: F401
    import torch.distributed.tensor  # noqa: F401

    from tpu_agent.backend import ops  # noqa: F401


def _profile_session(script: str, args: list[str]):
    """The profiler, when this run is a `tpu-agent profile` (imported only then)."""
    raw = envvars.PROFILE.pop()
    if raw is None:
        return None
    from tpu_agent.profilers.schema import Settings
    from tpu_agent.profilers.session import Session
    from tpu_agent.run.environment import collect_environment

    settings = Settings.model_validate_json(raw)
    run_dir = Path(envvars.RUN_DIR.get() or ".")
    fd = envvars.PROGRESS_FD.pop()
    progress = _progress_writer(int(fd)) if fd and fd.isdigit() else None
    session = Session(settings, run_dir, script, args, progress=progress, environment=collect_environment)
    _prepare_process(settings, run_dir)

    def terminate(signum, _frame):  # a timeout's SIGTERM still leaves a partial profile
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)
    return session


def _trial_session():
    """The timing-trial gate, when the tuner runs this child (imported only then)."""
    raw = envvars.TRIAL.pop()
    if raw is None:
        return None
    from tpu_agent.run.messages import TrialRequest
    from tpu_agent.run.trial_child import TrialSession

    return TrialSession(TrialRequest.model_validate_json(raw))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(USAGE, file=sys.stderr)
        raise SystemExit(2)
    # Absolute the way python makes __file__ absolute: joined to cwd, not normalised.
    script = argv[0] if os.path.isabs(argv[0]) else os.path.join(os.getcwd(), argv[0])

    # `python SCRIPT` puts the script's (symlink-resolved) directory first on
    # sys.path. Under -P nothing was prepended for us; without it, cwd was.
    script_dir = os.path.dirname(os.path.realpath(script))
    if sys.flags.safe_path:
        sys.path.insert(0, script_dir)
    else:
        sys.path[0] = script_dir
    sys.argv = [script, *argv[1:]]
    from tpu_agent.interrupts import keep_swallowed_interrupts

    keep_swallowed_interrupts()
    session = _profile_session(script, argv[1:])
    trial = _trial_session()
    plan = envvars.PLAN.pop()
    mapped = envvars.DEVICE_MAP.pop()

    # As if the script's first line were `import torch`: its entry points load
    # our device, after sys.path is the script's, exactly as for plain python.
    # Its ~250,000 objects live as long as the process: one full collection after the import instead of several
    # while the heap grows, and the script's own full collections no longer traverse them (gc.freeze). CPU of
    # `tpu-agent run` (parent and child): the MLP example 4.52 -> 3.82 s, a script that only prints 1.74 -> 1.42 s.
    # What the device's first op would import goes in before the freeze too (JAX, the lowerings, and DTensor,
    # which torch imports at a tensor subclass's first dispatch), so that neither the script's collections nor
    # the one at exit walk them: `tpu-agent run` of the MLP example, 5 steps, 3.5 -> 3.0 s wall (5 interleaved,
    # load 0.6); a script that never uses the device pays the imports, 1.35 -> 2.15 s. Not torch._dynamo: it
    # imports triton where installed, whose objects, frozen, nanobind reports as leaked at exit.
    gc.disable()
    try:
        import torch  # noqa: F401

        _import_what_the_first_op_would()
    finally:
        gc.collect()
        gc.freeze()
        gc.enable()

    from tpu_agent.backend.integration import module as device_module

    device_module.claim()  # Trainer, Accelerate and torch.accelerator take tpu here (not under plain python)
    from tpu_agent.backend.distributed import process_group

    process_group.name_set_timeout()
    if mapped is not None:  # before the profiler's hooks: its step-1 FLOP count runs under the map
        from tpu_agent.run import device_map

        device_map.apply(device_map.parse(mapped))
    if session is not None:
        session.start()
    if trial is not None:
        trial.start()
    elif plan is not None:  # `tpu-agent run --plan`: the plan's run-time actions
        from tpu_agent.plan.actions import Plan
        from tpu_agent.plan.runtime import apply_runtime

        apply_runtime(Plan.model_validate_json(plan))
    warn = session is None and trial is None  # profile and tune say it their own way
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if warn:
            _warn_if_untouched()
        if session is not None:
            status = _exit_status(exc)
            session.finish(status, None if status == 0 else f"SystemExit: {exc.code}")
        raise
    except BaseException as exc:  # noqa: BLE001 - report it as python would, then exit 1
        if trial is not None and trial.is_stop(exc):
            trial.finish(0, None)
            _leave_process_group()
            return
        if trial is not None:
            trial.finish(1, one_line(exc))
        if session is not None and session.is_stop(exc):
            session.finish(0, None)  # --steps reached: a clean stop at a step boundary
            _leave_process_group()
            _exit_if_not_written(session)
            return
        tb = _script_traceback(exc.__traceback__, script)
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        if warn and not isinstance(exc, KeyboardInterrupt):
            _warn_if_untouched(exc if mapped is None else None)
        if session is not None:
            session.finish(130 if isinstance(exc, KeyboardInterrupt) else 1, one_line(exc))
        if isinstance(exc, KeyboardInterrupt):
            # Re-raise so python ends the process by SIGINT after its normal
            # shutdown, as it does for a script; the traceback is already shown.
            sys.excepthook = lambda *_: None
            raise
        raise SystemExit(1) from None
    if warn:
        _warn_if_untouched()
    if session is not None:
        session.finish(0, None)
        _exit_if_not_written(session)
    if trial is not None:
        trial.finish(0, None)


def _leave_process_group() -> None:
    """A script stopped at a step boundary (every rank told at the same step) leaves its process group as the
    script's own end would: all ranks meet, then each destroys the group. Without it a rank still shutting down
    after another had closed its sockets could abort in gloo (SIGABRT: the launcher's exit 134)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not (dist.is_available() and dist.is_initialized()):
        return
    try:
        dist.barrier()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a rank already gone: the launcher ends the job as it would have
        pass


def _exit_if_not_written(session) -> None:
    """The script ran to its end but the environment refused its profile: the parent, told by this exit code,
    says why in its one line (no traceback of ours)."""
    if session.write_failed is not None:
        from tpu_agent.paths import CANNOT_WRITE_EXIT, record_refusal

        record_refusal(session.run_dir, session.write_failed)
        raise SystemExit(CANNOT_WRITE_EXIT)


def _warn_if_untouched(failure: BaseException | None = None) -> None:
    """A run whose model trained off the device says so last, on stderr (its exit status is the script's); so
    does a script that failed for want of CUDA, with the switch that runs it here."""
    from tpu_agent.run import device_use

    try:
        line = device_use.cuda_hint(failure) if failure is not None else None
        if line is None and device_use.trained_off_the_device():
            line = device_use.run_warning()
    except Exception:  # noqa: BLE001 - a check of ours must never change the script's outcome
        return
    if line is not None:
        sys.stdout.flush()
        print(line, file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
