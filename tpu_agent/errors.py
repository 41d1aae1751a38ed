"""Errors the CLI turns into one `error: ...` line and an exit code.

Commands raise these instead of printing, so every command fails the same way.
"""

from __future__ import annotations


class TpuAgentError(Exception):
    """The job failed (exit 1)."""

    exit_code = 1


class InputError(TpuAgentError):
    """Bad usage or bad input, caught before any work starts (exit 2)."""

    exit_code = 2


def validation_line(exc, *, where_if_none: str = "", more: bool = False) -> str:
    """A pydantic ValidationError as one line: `loc.of.field: message`, the first error only."""
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first.get("loc", ())) or where_if_none
    line = f"{where}: {first.get('msg')}" if where else str(first.get("msg"))
    if more and exc.error_count() > 1:
        line += f" (and {exc.error_count() - 1} more)"
    return line


def one_line(exc: BaseException, *, causes: bool = False) -> str:
    """`Type: message` on one line; with `causes`, the chain of causes too (a failing import's news)."""
    text = " ".join(str(exc).split())
    line = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    cause = exc.__cause__ if causes else None
    return f"{line} (caused by {one_line(cause, causes=True)})" if cause is not None else line
