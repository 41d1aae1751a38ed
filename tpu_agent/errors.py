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
