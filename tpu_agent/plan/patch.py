"""`tune --apply`: the verified source change written into the user's files, never over uncommitted edits."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from tpu_agent.errors import InputError
from tpu_agent.paths import RUNS_SUBDIR, shown_path
from tpu_agent.plan.actions import Plan
from tpu_agent.plan.batch_calls import run_time_actions
from tpu_agent.plan.rewrite import source_changes


def apply_patch(plan: Plan, script: Path, *, force: bool, say=print) -> None:
    """Write the plan's source edits into the user's files: refuses over uncommitted edits, keeps backups."""
    script_dir = script.resolve().parent
    changes = source_changes(plan, script)
    runtime = run_time_actions(plan, script)  # before the script is rewritten
    for change in changes:
        target = script_dir / change.path
        if not force and _uncommitted(target):
            raise InputError(f"{shown_path(target)} has uncommitted changes; commit them or pass --force")
    backups = Path.cwd() / RUNS_SUBDIR.parent / "backups"
    backups.mkdir(parents=True, exist_ok=True)
    for change in changes:
        target = script_dir / change.path
        backup = backups / f"{target.name}.{os.getpid()}.orig"
        shutil.copy2(target, backup)
        target.write_bytes(change.after)
        say(f"applied to {shown_path(target)} (backup: {shown_path(backup)})")
    if runtime:
        say(f"not applied (run-time parts of the plan, not source edits): "
            f"{'; '.join(a.instruction() or a.describe() for a in runtime)}; "
            "`tpu-agent run SCRIPT --plan plan.json` applies them all")


def _uncommitted(path: Path) -> bool:
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--", path.name], cwd=path.parent,
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    if out.returncode != 0:
        return False  # not a git work tree: nothing to lose track of, a backup is kept
    return bool(out.stdout.strip())


def uncommitted_sources(script: Path) -> list[str]:
    """The Python files under the script's directory with uncommitted changes (what `--apply` may edit)."""
    script_dir = script.resolve().parent
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--", "*.py"], cwd=script_dir,
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if out.returncode != 0:
        return []  # not a git work tree
    top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=script_dir, capture_output=True, text=True,
                         timeout=30).stdout.strip()
    return [shown_path(Path(top) / line[3:].strip().strip('"')) for line in out.stdout.splitlines() if line.strip()]
