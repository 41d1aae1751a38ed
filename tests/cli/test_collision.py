"""A user's own `backend.py` / `profilers.py` must keep working beside ours.

Our folders are mapped to `tpu_agent.backend` and `tpu_agent.profilers`; if
they ever became top-level `backend` / `profilers`, one side would shadow the
other. The script below imports both sides and proves each is what it claims.
"""

from __future__ import annotations

import importlib.util
import json
import textwrap
from pathlib import Path

import pytest

from support.processes import run_python, run_tool

USER_SCRIPT = """\
    import json, sys

    import backend            # the user's backend.py
    import profilers          # the user's profilers.py
    import tpu_agent_helpers  # a name that merely starts like ours
    import tpu_agent.backend
    import tpu_agent.backend.integration.autoload
    import tpu_agent.profilers

    print(json.dumps({
        "user_backend": [backend.__file__, backend.train_step(3)],
        "user_profilers": [profilers.__file__, profilers.KIND],
        "user_helpers": [tpu_agent_helpers.__file__, tpu_agent_helpers.twice(21)],
        "our_backend": [tpu_agent.backend.__file__, hasattr(tpu_agent.backend, "train_step")],
        "our_autoload_callable": callable(tpu_agent.backend.integration.autoload.autoload),
        "our_profilers": [tpu_agent.profilers.__file__, hasattr(tpu_agent.profilers, "KIND")],
        "entry_point_ran": "tpu_agent.backend.integration.autoload" in sys.modules,
    }))
    """


@pytest.fixture
def user_project(tmp_path: Path) -> Path:
    project = tmp_path / "project"
    project.mkdir()
    files = {
        "backend.py": "def train_step(x):\n    return x * 10\n",
        "profilers.py": "KIND = 'the user profiler'\n",
        "tpu_agent_helpers.py": "def twice(x):\n    return 2 * x\n",
        "train.py": textwrap.dedent(USER_SCRIPT),
    }
    for name, text in files.items():
        (project / name).write_text(text)
    return project


def check(out: str, project: Path) -> None:
    seen = json.loads(out)
    assert seen["user_backend"] == [str(project / "backend.py"), 30]
    assert seen["user_profilers"] == [str(project / "profilers.py"), "the user profiler"]
    assert seen["user_helpers"] == [str(project / "tpu_agent_helpers.py"), 42]
    # Ours are the installed package's, whatever the user's directory holds.
    ours_backend = importlib.util.find_spec("tpu_agent.backend").origin
    ours_profilers = importlib.util.find_spec("tpu_agent.profilers").origin
    assert seen["our_backend"] == [ours_backend, False]
    assert seen["our_profilers"] == [ours_profilers, False]
    assert seen["our_autoload_callable"] is True
    assert seen["entry_point_ran"] is True  # `import torch` loaded our device's entry point


@pytest.mark.parametrize("where", ["in the project", "elsewhere"])
def test_user_modules_and_ours_coexist_under_tpu_agent_run(user_project: Path, tmp_path: Path, where: str) -> None:
    cwd = user_project if where == "in the project" else tmp_path
    proc = run_tool("run", "-q", str(user_project / "train.py"), cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    check(proc.stdout, user_project)


def test_user_modules_and_ours_coexist_under_plain_python(user_project: Path) -> None:
    script = user_project / "train.py"
    script.write_text("import torch\n" + script.read_text())  # plain python needs torch imported to autoload
    proc = run_python("train.py", cwd=user_project)
    assert proc.returncode == 0, proc.stderr
    check(proc.stdout, user_project)
