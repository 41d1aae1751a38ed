"""The child process of a run: `python -P -m tpu_agent.run.child SCRIPT ARGS...`.

It makes the user's script see what `python SCRIPT ARGS...` would show it
(argv, cwd, `sys.path[0]`, `__name__ == "__main__"`, its own traceback and
exit status), with torch, and so our `tpu` device, loaded first. One
difference is unavoidable with runpy: `sys.argv[0]` is the absolute path, as
`__file__` already is under plain `python`. The profiler hooks in here when
the parent asks for it (`$TPU_AGENT_PROFILE`), between `import torch` and the
script; tuning plans will too.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
from types import TracebackType

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


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _profile_session(script: str, args: list[str]):
    """The profiler, when this run is a `tpu-agent profile` (imported only then)."""
    if "TPU_AGENT_PROFILE" not in os.environ:
        return None
    from tpu_agent.profilers.session import Session

    session = Session.from_env(script, args)
    if session is not None:
        session.prepare_process()

        def terminate(signum, _frame):  # a timeout's SIGTERM still leaves a partial profile
            raise SystemExit(128 + signum)

        signal.signal(signal.SIGTERM, terminate)
    return session


def _trial_session():
    """The timing-trial gate, when the tuner runs this child (imported only then)."""
    if "TPU_AGENT_TRIAL" not in os.environ:
        return None
    from tpu_agent.run.trial_child import TrialSession

    return TrialSession.from_env()


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
    session = _profile_session(script, argv[1:])
    trial = _trial_session()

    # As if the script's first line were `import torch`: its entry points load
    # our device, after sys.path is the script's, exactly as for plain python.
    import torch  # noqa: F401

    if session is not None:
        session.start()
    if trial is not None:
        trial.start()
    elif "TPU_AGENT_PLAN" in os.environ:  # `tpu-agent run --plan`: the plan's run-time actions
        from tpu_agent.plan.runtime import apply_runtime
        from tpu_agent.plan.actions import Plan

        apply_runtime(Plan.model_validate_json(os.environ.pop("TPU_AGENT_PLAN")))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if session is not None:
            status = _exit_status(exc)
            session.finish(status, None if status == 0 else f"SystemExit: {exc.code}")
        raise
    except BaseException as exc:  # noqa: BLE001 - report it as python would, then exit 1
        if trial is not None and type(exc).__name__ == "StopTrial":
            trial.finish(0, None)
            return
        if trial is not None:
            trial.finish(1, _one_line(exc))
        if session is not None and session.is_stop(exc):
            session.finish(0, None)  # --steps reached: a clean stop at a step boundary
            return
        tb = _script_traceback(exc.__traceback__, script)
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        if session is not None:
            session.finish(130 if isinstance(exc, KeyboardInterrupt) else 1, _one_line(exc))
        if isinstance(exc, KeyboardInterrupt):
            # Re-raise so python ends the process by SIGINT after its normal
            # shutdown, as it does for a script; the traceback is already shown.
            sys.excepthook = lambda *_: None
            raise
        raise SystemExit(1) from None
    if session is not None:
        session.finish(0, None)
    if trial is not None:
        trial.finish(0, None)


if __name__ == "__main__":
    main()
