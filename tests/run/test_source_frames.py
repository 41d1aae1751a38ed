"""The source line of an op is the user's, whatever their folders are called (a user's .../backend/train.py)."""

from __future__ import annotations

import runpy
import textwrap

from tpu_agent.backend.core import source


def test_a_user_script_in_a_folder_named_backend_keeps_its_lines(tmp_path):
    for folder in ("backend", "profilers", "tpu_agent", "torch"):
        script = tmp_path / "src" / folder / "train.py"
        script.parent.mkdir(parents=True)
        script.write_text(textwrap.dedent("""
            from tpu_agent.backend.core.source import user_frame

            def op():
                return user_frame(skip=1)

            WHERE = op()
        """))
        assert runpy.run_path(str(script))["WHERE"] == "train.py:5", folder


def test_our_own_frames_are_skipped():
    assert source.is_own_code(source.__file__)
    assert source.is_own_code(runpy.__file__)
    assert source.is_own_code("<frozen runpy>")
    assert not source.is_own_code("/home/me/src/backend/train.py")
