"""PadDim source edits: on a copy, byte for byte outside the literal, refused when stale, and a patch git applies."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tpu_agent.plan import rewrite
from tpu_agent.errors import InputError
from tpu_agent.plan.actions import PadDim, Plan
from tpu_agent.plan.rewrite import SourceChanged, apply_pad_dims, rewrite_source

GIT = shutil.which("git")

SOURCE = (
    "# -*- coding: utf-8 -*-\n"
    "BATCH   =  127   # rows: keep   the   spacing\n"
    "HIDDEN = 0x3ff  # hex stays hex\n"
    "WIDE = 2_047\n"
    "x = f(  'é→', 1023 )  # non-ASCII before the literal on this line\n"
)


def pad(file: str, line: int, column: int, old: int, new: int) -> PadDim:
    return PadDim(file=file, line=line, column=column, old=old, new=new)


def test_rewrite_changes_only_the_literals() -> None:
    edits = [pad("t.py", 2, 11, 127, 128), pad("t.py", 3, 9, 1023, 1024), pad("t.py", 4, 7, 2047, 2048),
             pad("t.py", 5, 14, 1023, 1024)]
    out = rewrite_source(SOURCE.encode(), edits, filename="t.py")
    expected = (SOURCE.replace("127", "128").replace("0x3ff", "0x400").replace("2_047", "2_048")
                .replace("1023 )", "1024 )"))
    assert out == expected.encode()


def test_rewrite_keeps_crlf_latin1_and_a_missing_final_newline() -> None:
    source = "# coding: latin-1\r\nNAME = 'caf\xe9'  # \xe9\r\nBATCH = 127".encode("latin-1")
    out = rewrite_source(source, [pad("t.py", 3, 8, 127, 128)], filename="t.py")
    assert out == source.replace(b"127", b"128")


@pytest.mark.parametrize(
    "edit,found",
    [
        (pad("t.py", 2, 11, 100, 128), "the source has 127"),  # value changed
        (pad("t.py", 2, 0, 127, 128), "found 'BATCH'"),  # a name, not a literal
        (pad("t.py", 2, 12, 127, 128), "found '27'"),  # inside the literal
        (pad("t.py", 40, 0, 127, 128), "no line 40"),
    ],
)
def test_stale_plan_is_refused_with_one_clear_message(edit: PadDim, found: str) -> None:
    with pytest.raises(SourceChanged) as info:
        rewrite_source(SOURCE.encode(), [edit], filename="t.py")
    message = str(info.value)
    assert found in message
    assert message.startswith(f"t.py:{edit.line}:{edit.column}: the plan expects")
    assert "changed since the plan was made" in message
    assert "\n" not in message
    assert info.value.exit_code == 2


# ------------------------------------------------------------------ trees


def make_tree(root: Path) -> Path:
    """A user's project: a script, a sibling module it imports, data, a venv, VCS and tool state."""
    src = root / "proj" / "train"
    (src / "data").mkdir(parents=True)
    (src / "data" / "x.bin").write_bytes(b"\0" * 100)
    (src / ".venv" / "lib").mkdir(parents=True)
    (src / ".venv" / "pyvenv.cfg").write_text("home = /usr\n")
    (src / "__pycache__").mkdir()
    (src / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"junk")
    (src / "pkg").mkdir()
    (src / "pkg" / "__init__.py").write_text("")
    (src / "pkg" / "sizes.py").write_text("VOCAB = 50257")  # no final newline
    (src / "model.py").write_text(textwrap.dedent("""\
        import torch.nn as nn  # not imported by the test script


        def build():
            # a comment   with   spaces
            return nn.Linear(1023,   10)
        """))
    (src / "train.py").write_text(textwrap.dedent("""\
        import pathlib
        from pkg.sizes import VOCAB

        BATCH = 127
        print(BATCH, VOCAB, pathlib.Path("data/x.bin").exists())
        """))
    (src / "crlf.py").write_bytes(b"A = 1\r\nB = 7\r\n")
    return src / "train.py"


def digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()}


PLAN = Plan(actions=[
    pad("train.py", 4, 8, 127, 128),
    pad("model.py", 6, 21, 1023, 1024),
    pad("pkg/sizes.py", 1, 8, 50257, 50304),
    pad("crlf.py", 2, 4, 7, 8),
])


def test_workspace_copy_runs_rewritten_and_user_files_stay(tmp_path: Path) -> None:
    script = make_tree(tmp_path)
    before = digest(tmp_path / "proj")
    ws = tmp_path / "ws"
    result = apply_pad_dims(PLAN, script, ws)
    assert digest(tmp_path / "proj") == before  # the user's tree is untouched
    assert result.script == ws.resolve() / "train.py"
    assert (ws / "model.py").read_text().endswith("return nn.Linear(1024,   10)\n")
    assert "# a comment   with   spaces" in (ws / "model.py").read_text()
    assert (ws / "crlf.py").read_bytes() == b"A = 1\r\nB = 8\r\n"
    assert (ws / "data").is_symlink()  # no Python inside: linked, not copied
    assert not (ws / ".venv").exists() and not (ws / "__pycache__").exists()
    assert [c.path for c in result.changes] == ["crlf.py", "model.py", "pkg/sizes.py", "train.py"]
    # The sibling import resolves to the rewritten copy, and relative data paths still work.
    proc = subprocess.run([sys.executable, str(result.script)], cwd=ws, capture_output=True, text=True, timeout=30)
    assert proc.stdout == "128 50304 True\n", proc.stderr


def test_stale_plan_writes_nothing(tmp_path: Path) -> None:
    script = make_tree(tmp_path)
    stale = Plan(actions=[pad("train.py", 4, 8, 127, 128), pad("model.py", 6, 21, 1000, 1024)])
    ws = tmp_path / "ws"
    with pytest.raises(SourceChanged, match=r"model.py:6:21: the plan expects the literal 1000, the source has 1023"):
        apply_pad_dims(stale, script, ws)
    assert not ws.exists()


@pytest.mark.parametrize("name", ["../evil.py", "/etc/passwd.py", "data/x.bin"])
def test_files_outside_the_script_dir_or_not_python_are_refused(tmp_path: Path, name: str) -> None:
    script = make_tree(tmp_path)
    with pytest.raises(InputError):
        apply_pad_dims([pad(name, 1, 0, 1, 8)], script, tmp_path / "ws")


def test_missing_file_is_a_stale_plan(tmp_path: Path) -> None:
    script = make_tree(tmp_path)
    with pytest.raises(SourceChanged, match="no such file"):
        apply_pad_dims([pad("gone.py", 1, 0, 1, 8)], script, tmp_path / "ws")


def test_workspace_inside_the_script_dir_does_not_loop(tmp_path: Path) -> None:
    script = make_tree(tmp_path)
    ws = script.parent / "out" / "trial-1"
    result = apply_pad_dims(PLAN, script, ws)
    assert (ws / "train.py").read_text().count("BATCH = 128") == 1
    assert not (ws / "out").exists()


def test_big_files_are_linked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = make_tree(tmp_path)
    (script.parent / "weights.pt").write_bytes(b"w" * 64)
    monkeypatch.setattr(rewrite, "LINK_FILES_FROM_BYTES", 32)
    apply_pad_dims(PLAN, script, tmp_path / "ws")
    assert (tmp_path / "ws" / "weights.pt").is_symlink()
    assert not (tmp_path / "ws" / "train.py").is_symlink()


# ------------------------------------------------------------------ the patch


def git(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", "-c", "core.autocrlf=false",
                           *args], cwd=cwd, capture_output=True, text=True, timeout=30)


@pytest.mark.skipif(GIT is None, reason="git is not installed")
def test_patch_applies_with_git_apply(tmp_path: Path) -> None:
    script = make_tree(tmp_path)
    repo = tmp_path / "proj"
    assert git("init", "-q", cwd=repo).returncode == 0
    assert git("add", "-A", cwd=repo).returncode == 0
    assert git("commit", "-q", "-m", "base", cwd=repo).returncode == 0
    result = apply_pad_dims(PLAN, script, tmp_path / "ws")
    assert result.patch_root == repo.resolve()  # headers relative to the work tree's top: plain `git apply` works
    patch = result.write_patch(tmp_path / "patch.diff")
    text = patch.read_text()
    assert "diff --git a/train/train.py b/train/train.py" in text
    assert "-BATCH = 127\n+BATCH = 128\n" in text
    assert "\\ No newline at end of file" in text  # pkg/sizes.py
    check = git("apply", "--check", "-v", str(patch), cwd=repo)
    assert check.returncode == 0, check.stderr
    # Applied for real (in the scratch repo), the user's files become the workspace's.
    assert git("apply", str(patch), cwd=repo).returncode == 0
    for change in result.changes:
        assert (script.parent / change.path).read_bytes() == (tmp_path / "ws" / change.path).read_bytes()
    # And a tree that moved on since is refused by git, not silently patched.
    assert git("checkout", "-q", "--", ".", cwd=repo).returncode == 0
    (script.parent / "train.py").write_text((script.parent / "train.py").read_text().replace("BATCH = 127", "BATCH = 64"))
    assert git("apply", "--check", str(patch), cwd=repo).returncode != 0


def test_patch_root_without_git_is_the_script_dir(tmp_path: Path) -> None:
    script = make_tree(tmp_path)
    result = apply_pad_dims([pad("train.py", 4, 8, 127, 128)], script, tmp_path / "ws")
    if result.patch_root != script.parent.resolve():  # tmp_path itself inside a git work tree
        pytest.skip("tmp dir is inside a git work tree")
    assert result.patch.startswith("diff --git a/train.py b/train.py\n--- a/train.py\n+++ b/train.py\n")
