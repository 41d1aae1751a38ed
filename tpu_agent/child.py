"""The child process of a run: `python -P -m tpu_agent.child SCRIPT ARGS...`.

It makes the user's script see what `python SCRIPT ARGS...` would show it
(argv, cwd, `sys.path[0]`, `__name__ == "__main__"`, its own traceback and
exit status), with torch, and so our `tpu` device, loaded first. One
difference is unavoidable with runpy: `sys.argv[0]` is the absolute path, as
`__file__` already is under plain `python`. Later the profiler hooks and
tuning plans install here, between `import torch` and the script.
"""

from __future__ import annotations

import os
import runpy
import sys
from types import TracebackType

USAGE = "usage: python -m tpu_agent.child SCRIPT [ARGS...]"


def _script_traceback(tb: TracebackType | None, script: str) -> TracebackType | None:
    """Drop our frames (this module, runpy) above the script's first frame."""
    cur = tb
    while cur is not None:
        if cur.tb_frame.f_code.co_filename == script:
            return cur
        cur = cur.tb_next
    return tb  # the failure was not in the script: show everything


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

    # As if the script's first line were `import torch`: its entry points load
    # our device, after sys.path is the script's, exactly as for plain python.
    import torch  # noqa: F401

    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - report it as python would, then exit 1
        tb = _script_traceback(exc.__traceback__, script)
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        if isinstance(exc, KeyboardInterrupt):
            # Re-raise so python ends the process by SIGINT after its normal
            # shutdown, as it does for a script; the traceback is already shown.
            sys.excepthook = lambda *_: None
            raise
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
