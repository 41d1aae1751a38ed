"""Checks on user-supplied inputs, shared by every command that takes a script.

Failing here, before a child process starts, turns a typo or a syntax error
into one `error:` line (exit 2) instead of a traceback from deep inside a run.
"""

from __future__ import annotations

import io
import tokenize
from pathlib import Path

from tpu_agent.errors import InputError


def check_script(path: str | Path) -> Path:
    """Return `path` if it names a readable Python file that compiles; raise InputError if not."""
    shown = str(path)
    p = Path(path)
    if not p.exists():
        raise InputError(f"script not found: {shown}")
    if not p.is_file():
        raise InputError(f"not a file: {shown}")
    try:
        source = p.read_bytes()
    except OSError as exc:
        raise InputError(f"cannot read {shown}: {exc.strerror or exc}") from None
    try:
        # python refuses a file that is not in its declared encoding (UTF-8 without a coding line);
        # compile() on bytes lets an undecodable comment through, so decode first, as python does.
        try:
            encoding, _ = tokenize.detect_encoding(io.BytesIO(source).readline)
        except SyntaxError as exc:
            if "unknown encoding" in str(exc):
                raise
            encoding = "utf-8"  # its first lines do not decode: say where below
        source.decode(encoding)
    except UnicodeDecodeError as exc:
        line = source[:exc.start].count(b"\n") + 1
        raise InputError(f"{shown} line {line} is not valid {exc.encoding}: byte {source[exc.start]:#04x} "
                         "(save it as UTF-8, or declare its encoding on the first line, e.g. "
                         "`# -*- coding: latin-1 -*-`)") from None
    except SyntaxError as exc:  # an unknown coding name
        raise InputError(f"syntax error in {shown}: {exc.msg}") from None
    try:
        # bytes, so a PEP 263 coding line is honoured exactly as `python SCRIPT` would.
        compile(source, shown, "exec", dont_inherit=True)
    except SyntaxError as exc:
        where = f" line {exc.lineno}" if exc.lineno else ""
        raise InputError(f"syntax error in {shown}{where}: {exc.msg}") from None
    except ValueError as exc:  # e.g. null bytes in the source
        raise InputError(f"cannot compile {shown}: {exc}") from None
    return p
