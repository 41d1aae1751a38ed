"""`python -m tpu_agent.run.torchrun ARGS...`: PyTorch's own launcher (torch.distributed.run, what `torchrun`
runs), with one difference: a failed job exits with its first failed rank's exit code (a death by signal N:
128 + N), where torchrun exits 1. torchrun's summary of the failure (which rank, its exit code) is printed as
torchrun prints it, and the rank's own traceback has already gone to stderr. `tpu-agent run --nproc N`
starts this (run/launch.py).
"""

from __future__ import annotations

import sys


def exit_code(code: int | None) -> int:
    if code is None:
        return 1
    return 128 - code if code < 0 else (code or 1)


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        run(args)
    except ChildFailedError as err:
        print(str(err), file=sys.stderr)
        _rank, failure = err.get_first_failure()
        return exit_code(failure.exitcode)
    except SignalException as err:  # SIGTERM or SIGINT to the launcher: it stopped every rank first
        return 128 + int(err.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
