"""Where tpu-agent keeps things, in one place so every command agrees."""

from __future__ import annotations

import re
import time
from pathlib import Path

from tpu_agent.envvars import cache_dir  # noqa: F401 - the one rule ($TPU_AGENT_CACHE_DIR, XDG, ~/.cache), declared there

RUNS_SUBDIR = Path(".tpu-agent") / "runs"


def runs_dir(cwd: Path | None = None) -> Path:
    """Runs live beside the user's work (`./.tpu-agent/runs`), not in the cache."""
    return (cwd or Path.cwd()) / RUNS_SUBDIR


def new_run_dir(script: Path, root: Path | None = None) -> Path:
    """Create `<root>/<YYYYmmdd-HHMMSS>-<script stem>/`, suffixing `-2`, `-3`... on a clash."""
    root = root if root is not None else runs_dir()
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", script.stem) or "script"
    base = f"{time.strftime('%Y%m%d-%H%M%S')}-{stem}"
    root.mkdir(parents=True, exist_ok=True)
    ignore_tool_dir(root)
    for n in range(1, 10_000):
        candidate = root / (base if n == 1 else f"{base}-{n}")
        try:
            candidate.mkdir()
        except FileExistsError:
            continue
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
