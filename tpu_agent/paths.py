"""Where tpu-agent keeps things, and how it writes them, in one place so every command agrees.

Writing follows one policy for what the environment refuses: a full disk, a read-only folder, a missing or
unwritable directory, a permission error give the same one line in every command, naming the path and what was
being written, exit 2 when found before any work started and 1 after. Files are written to a temporary name and
renamed, so nothing half-written is left behind looking complete.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import time
from pathlib import Path

from tpu_agent.envvars import cache_dir  # noqa: F401 - the one rule ($TPU_AGENT_CACHE_DIR, XDG, ~/.cache), declared there
from tpu_agent.errors import InputError, TpuAgentError

RUNS_SUBDIR = Path(".tpu-agent") / "runs"


def runs_dir(cwd: Path | None = None) -> Path:
    """Runs live beside the user's work (`./.tpu-agent/runs`), not in the cache."""
    return (cwd or Path.cwd()) / RUNS_SUBDIR


def new_run_dir(script: Path, root: Path | None = None) -> Path:
    """Create `<root>/<YYYYmmdd-HHMMSS>-<script stem>/`, suffixing `-2`, `-3`... on a clash."""
    root = root if root is not None else runs_dir()
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", script.stem) or "script"
    base = f"{time.strftime('%Y%m%d-%H%M%S')}-{stem}"
    make_dir(root, "the runs directory")
    ignore_tool_dir(root)
    for n in range(1, 10_000):
        candidate = root / (base if n == 1 else f"{base}-{n}")
        try:
            candidate.mkdir()
        except FileExistsError:
            continue
        except OSError as exc:
            raise CannotWriteBefore(refused(exc, candidate, "the run directory")) from None
        return candidate
    raise FileExistsError(f"too many runs named {base} in {root}")


def shown_path(path: str | Path) -> str:
    """`path` relative to the working directory when it lies below it (as people read it), else as given."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except (ValueError, OSError):
        return str(path)


def ignore_tool_dir(path: Path) -> None:
    """A `.gitignore` holding `*` in the `.tpu-agent/` at or above `path` (as pytest does for its cache), so the
    runs, the studies and the backups never show up as untracked in the user's repository."""
    for d in (path, *path.parents[:2]):
        if d.name == RUNS_SUBDIR.parent.name:
            ignore = d / ".gitignore"
            if not ignore.exists():
                try:
                    ignore.write_text("# created by tpu-agent: its runs, studies and backups\n*\n")
                except OSError:
                    pass
            return


# --- writing: one policy for what the environment refuses

CANNOT_WRITE_EXIT = 74  # a run's child that could not write its profile (sysexits' EX_IOERR): the parent says why


class CannotWrite(TpuAgentError):
    """The environment refused one of our files after work began (exit 1)."""


class CannotWriteBefore(InputError):
    """The environment refuses our files before any work began (exit 2)."""


REFUSED_FILE = "profile.refused"  # a child whose profile was refused writes why here, if the disk takes that much

_CAUSES = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is used up",
           errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied",
           errno.EPERM: "permission denied", errno.EFBIG: "the file is larger than allowed"}


def cause(exc: OSError) -> str:
    """Why the environment refused a write, said as its cause: `the disk is full (ENOSPC: No space left on
    device)`, not only that it was refused."""
    code = exc.errno
    name = errno.errorcode.get(code) if code is not None else None
    text = exc.strerror or exc.__class__.__name__
    said = _CAUSES.get(code)
    if said is None:
        return f"{name}: {text}" if name else text
    return f"{said} ({name}: {text})"


def record_refusal(run_dir: Path | str, exc: OSError) -> None:
    """In a run's child: why its profile was refused, for the parent's one line (best effort: a full disk may not
    take even this)."""
    with contextlib.suppress(OSError):
        (Path(run_dir) / REFUSED_FILE).write_text(cause(exc) + "\n")


def refusal_of_run(run_dir: Path | str) -> str:
    """Why a run's profile was refused: what its child recorded, else what the folder refuses now, else said
    unknown."""
    with contextlib.suppress(OSError):
        recorded = (Path(run_dir) / REFUSED_FILE).read_text().strip()
        if recorded:
            return recorded
    return probe_refusal(run_dir) or "refused while the run wrote it (the cause was not recorded)"


def refused(exc: OSError, path: Path | str, what: str) -> str:
    """The one line: what, where, why."""
    return f"cannot write {what} {path}: {cause(exc)}"


@contextlib.contextmanager
def writing(path: Path | str, what: str, *, before_work: bool = False):
    """An OSError inside becomes the policy's one line."""
    try:
        yield
    except OSError as exc:
        error = CannotWriteBefore if before_work else CannotWrite
        raise error(refused(exc, path, what)) from None


def write_atomic(path: Path, data: str | bytes, what: str, *, before_work: bool = False) -> Path:
    """`data` at `path` whole or not at all (a temporary file renamed over it)."""
    path = Path(path)
    with _replacing(path, what, before_work) as tmp:
        if isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data)
    return path


def save_figure(fig, path: Path, what: str, **options) -> Path:
    """A matplotlib figure, whole or not at all (its format from the suffix)."""
    path = Path(path)
    with _replacing(path, what) as tmp:
        fig.savefig(tmp, format=path.suffix.lstrip(".") or None, **options)
    return path


@contextlib.contextmanager
def _replacing(path: Path, what: str, before_work: bool = False):
    """A temporary name beside `path`, renamed over it once written; removed if writing fails."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with writing(path, what, before_work=before_work):
        try:
            yield tmp
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise


def make_dir(path: Path, what: str, *, before_work: bool = True) -> Path:
    """`path` and its parents, or the policy's line."""
    with writing(path, what, before_work=before_work):
        path.mkdir(parents=True, exist_ok=True)
    return path


def writable_dir(path: Path, what: str) -> Path:
    """`path` created if needed and proven to take a file, before any work (exit 2 with the line if not)."""
    path = make_dir(Path(path), what)
    reason = probe_refusal(path)
    if reason is not None:
        raise CannotWriteBefore(f"cannot write {what} {path}: {reason}")
    return path


def probe_refusal(directory: Path | str) -> str | None:
    """Why `directory` refuses a file now (a full disk, a read-only folder), or None if it takes one."""
    probe = Path(directory) / f".tpu-agent-probe-{os.getpid()}"
    try:
        probe.write_bytes(b"0" * 4096)
    except OSError as exc:
        return cause(exc)
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()
    return None


# SQLite's words for a write the file system refused (it keeps no errno): the study storage's file
_SQLITE_REFUSED = ("database or disk is full", "disk I/O error", "attempt to write a readonly database",
                   "unable to open database file")


def database_refusal(path: Path | str, exc: BaseException) -> str | None:
    """Why a SQLite file (the study storage) refused a write, said as its cause: its folder probed (a full disk,
    a read-only folder), else SQLite's own words when they name the disk; None for any other failure."""
    text = str(exc)
    if not any(words in text for words in _SQLITE_REFUSED):
        return None
    probed = probe_refusal(Path(path).parent)
    if probed is not None:
        return probed
    return "the disk is full (SQLite: database or disk is full)" if _SQLITE_REFUSED[0] in text else None
