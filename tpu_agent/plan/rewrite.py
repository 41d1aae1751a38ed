"""Apply `PadDim` actions to a copy of the user's script tree, and write the patch a reviewer reads.

The user's files are never touched: the script's directory is mirrored into
a workspace, the literals are rewritten there with libcst (every byte outside
the literal kept: comments, spacing, line endings, encoding), and a unified
diff against the user's files is produced that `git apply` accepts.

A plan names a literal by file, line and column (libcst's: 1-based line,
0-based column in characters) and its old value. If the source no longer has
that value there, the plan is stale and is refused with `SourceChanged`
(exit 2) rather than guessed at.
"""

from __future__ import annotations

import difflib
import os
import re
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from tpu_agent.errors import InputError
from tpu_agent.paths import write_atomic
from tpu_agent.plan.actions import PadDim, Plan

# Never mirrored: tool state, VCS metadata, caches, virtual environments (found by pyvenv.cfg too).
SKIP_DIRS = frozenset({
    ".git", ".hg", ".svn", ".tpu-agent", ".venv", "__pycache__", ".mypy_cache", ".pytest_cache",
    ".ruff_cache", ".ipynb_checkpoints", ".tox", ".nox", "node_modules",
})
# Files at least this big are linked, not copied: datasets and checkpoints, read by the script.
LINK_FILES_FROM_BYTES = 8 << 20


class SourceChanged(InputError):
    """A plan's literal is not where, or not what, the plan says: the source changed since the plan was made."""


@dataclass(frozen=True)
class FileChange:
    """One rewritten file: its path relative to the script's directory, before and after."""

    path: str
    before: bytes
    after: bytes
    edits: tuple[PadDim, ...]


@dataclass
class Rewrite:
    """The result of applying a plan's source edits in a workspace."""

    workspace: Path  # mirror of the script's directory
    script: Path  # the script inside the workspace: run this one
    changes: list[FileChange] = field(default_factory=list)
    patch: str = ""  # unified diff against the user's files, paths relative to patch_root
    patch_root: Path | None = None  # run `git apply patch.diff` here

    def write_patch(self, path: Path) -> Path:
        path = Path(path)
        # Bytes as built: a CRLF or Latin-1 source must reach `git apply` unchanged.
        return write_atomic(path, self.patch.encode("utf-8", "surrogateescape"), "the patch")


# ------------------------------------------------------------------ one file


def _token_at(text: str, line: int, column: int) -> str:
    lines = re.split(r"\r\n|\r|\n", text)  # libcst's line breaks (str.splitlines also splits on \f)
    if not 1 <= line <= len(lines):
        return f"no line {line} (the file has {len(lines)})"
    if column > len(lines[line - 1]):
        return f"line {line} has only {len(lines[line - 1])} characters"
    match = re.match(r"\w+|\S", lines[line - 1][column:])
    return repr(match.group(0)) if match else "nothing"


def _literal_text(original: str, new: int) -> str:
    """Write the new value in the old literal's style (hex stays hex, 1_024 keeps its underscores)."""
    lowered = original.lower()
    if lowered.startswith("0x"):
        return hex(new)
    if lowered.startswith("0o"):
        return oct(new)
    if lowered.startswith("0b"):
        return bin(new)
    if "_" in original:
        return f"{new:_}"
    return str(new)


def rewrite_source(source: bytes, edits: Sequence[PadDim], *, filename: str) -> bytes:
    """Return `source` with each edit's integer literal replaced; SourceChanged if one is not there as planned."""
    import libcst as cst
    from libcst.metadata import MetadataWrapper, PositionProvider

    try:
        module = cst.parse_module(source)
    except cst.ParserSyntaxError as exc:
        raise SourceChanged(f"{filename} no longer parses ({exc.message.rstrip('.')} at line {exc.raw_line}); "
                            f"the plan was made for another version of it") from None
    wanted = {(e.line, e.column): e for e in edits}
    found: dict[tuple[int, int], PadDim] = {}

    class Pad(cst.CSTTransformer):
        METADATA_DEPENDENCIES = (PositionProvider,)

        def leave_Integer(self, original: cst.Integer, updated: cst.Integer) -> cst.BaseExpression:
            start = self.get_metadata(PositionProvider, original).start
            edit = wanted.get((start.line, start.column))
            if edit is None:
                return updated
            value = original.evaluated_value
            if value != edit.old:
                raise SourceChanged(
                    f"{filename}:{edit.line}:{edit.column}: the plan expects the literal {edit.old}, the source has "
                    f"{original.value}; the script changed since the plan was made (make a new plan)")
            found[(start.line, start.column)] = edit
            return updated.with_changes(value=_literal_text(original.value, edit.new))

    new_module = MetadataWrapper(module).visit(Pad())
    for where, edit in wanted.items():
        if where not in found:
            text = source.decode(module.encoding, errors="replace")
            raise SourceChanged(
                f"{filename}:{edit.line}:{edit.column}: the plan expects the integer literal {edit.old}, found "
                f"{_token_at(text, edit.line, edit.column)}; the script changed since the plan was made (make a new plan)")
    return new_module.bytes


# ------------------------------------------------------------------ paths


def _relative_file(name: str, root: Path) -> Path:
    """The edit's file inside the script's directory; plans come from models and files, so no escaping it."""
    pure = PurePosixPath(name.replace("\\", "/"))
    if pure.is_absolute() or not pure.parts or ".." in pure.parts:
        raise InputError(f"pad_dim file {name!r} must be a relative path inside the script's directory")
    path = root / Path(*pure.parts)
    if path.suffix != ".py":
        raise InputError(f"pad_dim file {name!r} is not a Python file")
    if not path.is_file():
        raise SourceChanged(f"{name}: no such file beside the script; the source changed since the plan was made")
    return path


def planned_changes(actions: Iterable[PadDim] | Plan, script_dir: Path) -> list[FileChange]:
    """Rewrite in memory every file the plan's PadDim actions name; raises before anything is written."""
    pads = actions.of(PadDim) if isinstance(actions, Plan) else list(actions)
    by_file: dict[str, list[PadDim]] = {}
    for edit in pads:
        key = PurePosixPath(edit.file.replace("\\", "/")).as_posix()
        by_file.setdefault(key, []).append(edit)
    changes = []
    for name, edits in sorted(by_file.items()):
        path = _relative_file(name, script_dir)
        before = path.read_bytes()
        after = rewrite_source(before, edits, filename=name)
        changes.append(FileChange(path=name, before=before, after=after, edits=tuple(edits)))
    return changes


def source_changes(plan: Plan, script: Path) -> list[FileChange]:
    """Every source edit of the plan, for the patch and `--apply`: its PadDim literals and, for a fixed-length
    pad_batch, `pad_to_multiple_of` in the script's padding calls (batch_calls.py; the run-time form was measured)."""
    from tpu_agent.plan.batch_calls import fixed_length, pad_calls_to, padding_calls

    script = Path(script).resolve()
    changes = planned_changes(plan, script.parent)
    length = fixed_length(plan)
    if length is None:
        return changes
    mine = next((c for c in changes if (script.parent / c.path).resolve() == script), None)
    before = mine.before if mine else script.read_bytes()
    current = mine.after if mine else before
    if not padding_calls(current):
        return changes
    edited = FileChange(path=mine.path if mine else script.name, before=before, after=pad_calls_to(current, length),
                        edits=mine.edits if mine else ())
    return [edited if c is mine else c for c in changes] if mine else [*changes, edited]


def write_source_patch(plan: Plan, script: Path, path: Path) -> Path | None:
    """Write the plan's source edits as a patch (`git apply`) at `path`; None when the plan edits no source."""
    changes = source_changes(plan, script)
    if not changes:
        return None
    script_dir = Path(script).resolve().parent
    patch = unified_diff(changes, script_dir=script_dir, patch_root=find_patch_root(script_dir))
    return write_atomic(Path(path), patch.encode("utf-8", "surrogateescape"), "the patch")


def find_patch_root(script_dir: Path) -> Path:
    """The git work tree holding the script (so `git apply` works from its top), else the script's directory."""
    here = script_dir.resolve()
    for candidate in (here, *here.parents):
        if (candidate / ".git").exists():
            return candidate
    return here


# ------------------------------------------------------------------ diff


def unified_diff(changes: Sequence[FileChange], *, script_dir: Path, patch_root: Path) -> str:
    """A git-style unified diff of the changes, paths relative to `patch_root` (a/ and b/ prefixes)."""
    base = script_dir.resolve().relative_to(patch_root.resolve())
    out: list[bytes] = []
    for change in changes:
        rel = (PurePosixPath(base.as_posix()) / change.path).as_posix() if base.parts else change.path
        name = rel.encode("utf-8")
        before = change.before.splitlines(keepends=True)
        after = change.after.splitlines(keepends=True)
        if before == after:
            continue
        out.append(b"diff --git a/" + name + b" b/" + name + b"\n")
        for line in difflib.diff_bytes(difflib.unified_diff, before, after, b"a/" + name, b"b/" + name, n=3):
            if not line.endswith(b"\n"):
                # A last line without a newline: diff's marker, as git writes it.
                line += b"\n\\ No newline at end of file\n"
            out.append(line)
    return b"".join(out).decode("utf-8", "surrogateescape")


# ------------------------------------------------------------------ workspace


def _has_python(directory: Path) -> bool:
    for _root, dirs, files in os.walk(directory):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS]
        if any(f.endswith((".py", ".pyi", ".so", ".pyd", ".pth")) for f in files):
            return True
    return False


def _link(src: Path, dst: Path) -> None:
    target = os.readlink(src) if src.is_symlink() else str(src)
    if not os.path.isabs(target):
        target = os.path.normpath(os.path.join(src.parent, target))
    os.symlink(target, dst, target_is_directory=Path(target).is_dir())


def mirror(script_dir: Path, workspace: Path) -> None:
    """Mirror the script's directory into `workspace` so the script runs there as it would at home.

    Python files and small files are copied (they may be rewritten); folders
    without Python code (data, outputs) and other files of 8 MiB or more are linked,
    so a trial costs milliseconds, not a dataset copy, and the script reads and
    writes them where it always does. Tool state, VCS metadata, caches and
    virtual environments are left out.
    """
    src_root = script_dir.resolve()
    dst_root = workspace.resolve()
    dst_root.mkdir(parents=True, exist_ok=True)
    for current, dirs, files in os.walk(src_root):
        here = Path(current)
        out = dst_root / here.relative_to(src_root)
        keep = []
        for d in sorted(dirs):
            src = here / d
            if d in SKIP_DIRS or (src / "pyvenv.cfg").exists():
                continue
            real = src.resolve()
            if real == dst_root:
                continue  # the workspace itself
            if dst_root.is_relative_to(real):
                continue  # it holds the workspace (tool output): a link or a copy would loop
            if src.is_symlink():
                _link(src, out / d)
            elif _has_python(src):
                (out / d).mkdir(exist_ok=True)
                keep.append(d)
            else:
                _link(src, out / d)
        dirs[:] = keep
        for f in files:
            src = here / f
            big = src.is_file() and src.stat().st_size >= LINK_FILES_FROM_BYTES and not f.endswith(".py")
            if src.is_symlink() or big:
                _link(src, out / f)
            elif src.is_file():
                shutil.copy2(src, out / f)


def apply_pad_dims(actions: Iterable[PadDim] | Plan, script: Path, workspace: Path, *,
                   patch_root: Path | None = None) -> Rewrite:
    """Check the plan's source edits, mirror the script's directory into `workspace`, rewrite the copies.

    Raises SourceChanged before writing anything if a literal is not as the
    plan says. The returned Rewrite names the script to run and the patch.
    """
    script = Path(script).resolve()
    script_dir = script.parent
    changes = planned_changes(actions, script_dir)
    workspace = Path(workspace)
    if workspace.exists() and any(workspace.iterdir()):
        raise InputError(f"workspace {workspace} is not empty")
    mirror(script_dir, workspace)
    for change in changes:
        target = workspace / Path(*PurePosixPath(change.path).parts)
        if target.is_symlink():  # never write through a link into the user's tree
            target.unlink()
        target.write_bytes(change.after)
        shutil.copystat(script_dir / Path(*PurePosixPath(change.path).parts), target)
    root = patch_root if patch_root is not None else find_patch_root(script_dir)
    return Rewrite(
        workspace=workspace.resolve(), script=workspace.resolve() / script.name, changes=changes,
        patch=unified_diff(changes, script_dir=script_dir, patch_root=root), patch_root=root.resolve(),
    )
