"""`python -m tpu_agent.run.torchrun ARGS...`: PyTorch's own launcher (torch.distributed.run, what `torchrun`
runs), with these differences, all in how a failed job ends:

- It exits with the exit code of the rank whose failure stopped the job (a death by signal N: 128 + N), where
  torchrun exits 1. That rank is the first to fail that was not a consequence: a rank whose collective failed
  because another rank's process ended says so in its torchrun error file (backend/distributed/faults.py), and
  a rank the launcher itself stopped (SIGTERM, SIGKILL) comes after any other. torchrun's summary names it
  as the root cause; the rank's own traceback has already gone to stderr.
- A rank's bad input (a mesh the job cannot take, a port in use) is that rank's one `error:` line, printed
  here once, and exit 2; so is a MASTER_PORT in use when the launcher starts its store.
`tpu-agent run --nproc N` starts this (run/launch.py).
"""

from __future__ import annotations

import re
import signal
import sys

USAGE_EXIT = 2
STOPPED_BY_LAUNCHER = (-signal.SIGTERM, -signal.SIGKILL)


def exit_code(code: int | None) -> int:
    if code is None:
        return 1
    return 128 - code if code < 0 else (code or 1)


def root_cause(failures: dict) -> tuple[int, object]:
    """(rank, ProcessFailure) of the failure that stopped the job: a rank that said it was the cause (a timeout,
    bad input) first, ranks that said they were a consequence last; among the rest, ranks the launcher stopped
    after the others; then by time and rank."""
    from tpu_agent.backend.distributed.faults import CAUSE, CONSEQUENCE, USAGE, kind_of

    def order(rank: int):
        failure = failures[rank]
        kind = kind_of(failure.error_file_data)
        said = 0 if kind in (CAUSE, USAGE) else 2 if kind == CONSEQUENCE else 1  # what the rank said of itself
        return said, failure.exitcode in STOPPED_BY_LAUNCHER, failure.timestamp, rank

    rank = min(failures, key=order)
    return rank, failures[rank]


def main(argv: list[str] | None = None) -> int:
    from torch.distributed import DistNetworkError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from tpu_agent.backend.distributed.faults import USAGE, kind_of, message_of

    class Failed(ChildFailedError):
        def get_first_failure(self):
            return root_cause(self.failures)

    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        run(args)
    except ChildFailedError as err:
        _rank, failure = root_cause(err.failures)
        if kind_of(failure.error_file_data) == USAGE:
            print(message_of(failure.error_file_data), file=sys.stderr)
            return USAGE_EXIT
        print(str(Failed(err.name, err.failures)), file=sys.stderr)
        return exit_code(failure.exitcode)
    except SignalException as err:  # SIGTERM or SIGINT to the launcher: it stopped every rank first
        return 128 + int(err.sigval)
    except DistNetworkError as err:
        if "EADDRINUSE" not in str(err):
            raise
        port = re.search(r"port: (\d+)", str(err))
        where = f"port {port.group(1)}" if port else "its port"
        print(f"error: the launcher could not start its store: {where} (MASTER_PORT) is in use; launch with "
              "another --master-port", file=sys.stderr)
        return USAGE_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(main())
