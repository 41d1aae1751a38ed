"""The CLI as a user meets it: exit codes, one-line errors, and `run` fidelity."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import platform
import re
import textwrap
from pathlib import Path

import pytest

from support.processes import clean_env, one_error_line, run_python, run_tool
from tpu_agent import __version__
from tpu_agent.run.environment import Environment
from tpu_agent.run.launch import RUN_DIR_ENV, RunResult


def write(path: Path, source: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source))
    return path


# ------------------------------------------------------------------ basics


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_lists_commands(tmp_path: Path, flag: str) -> None:
    proc = run_tool(flag, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "Usage: tpu-agent" in proc.stdout
    for command in ("run", "doctor"):
        assert re.search(rf"^\W*{command}\b", proc.stdout, re.M), f"{command} missing from help:\n{proc.stdout}"


def test_bare_command_shows_help(tmp_path: Path) -> None:
    proc = run_tool(cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "Usage: tpu-agent" in proc.stdout


def test_version(tmp_path: Path) -> None:
    proc = run_tool("--version", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"tpu-agent {__version__}\n"
    assert __version__ == importlib.metadata.version("tpu-agent")


def test_run_help_documents_the_separator(tmp_path: Path) -> None:
    proc = run_tool("run", "--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "SCRIPT" in proc.stdout and "--" in proc.stdout


# ------------------------------------------------------------------ doctor


def doctor_json(tmp_path: Path, **env: str) -> tuple[Environment, str]:
    proc = run_tool("doctor", "--json", cwd=tmp_path, env=clean_env(**env))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return Environment.model_validate_json(proc.stdout), proc.stdout + proc.stderr


def test_doctor_json_reports_the_real_environment_and_a_cache_dir_that_follows_xdg_never_printing_the_api_key(
        tmp_path: Path) -> None:
    """Two `doctor --json` runs: with XDG_CACHE_HOME and an API key set (never printed), the cache under XDG; with
    neither, under HOME, and no key. Both report the real environment: versions, JAX's devices, runs dir, no
    problem. (TPU_AGENT_CACHE_DIR over both: test_doctor_text.)"""
    import jax
    import torch

    def real(env: Environment) -> None:
        assert env.tpu_agent_version == __version__
        assert env.python_version == platform.python_version()
        assert env.torch_version == torch.__version__
        assert env.jax_version == importlib.metadata.version("jax")
        assert env.jaxlib_version == importlib.metadata.version("jaxlib")
        assert env.jax_default_backend == jax.default_backend()
        assert [d.id for d in env.jax_devices] == [d.id for d in jax.devices()]
        assert {d.platform for d in env.jax_devices} == {env.jax_default_backend}
        assert env.torch_tpu_importable == (importlib.util.find_spec("torch_tpu") is not None)
        assert env.torch_tpu_device == (torch._C._get_privateuse1_backend_name() == "tpu")
        assert env.runs_dir == str(tmp_path / ".tpu-agent" / "runs")
        assert env.problems == []

    secret = "sk-ant-api03-TESTSECRET-0123456789abcdef"
    env, everything = doctor_json(tmp_path, XDG_CACHE_HOME=str(tmp_path / "xdg"), ANTHROPIC_API_KEY=secret)
    real(env)
    assert env.cache_dir == str(tmp_path / "xdg" / "tpu-agent")
    assert env.anthropic_api_key_set is True
    assert secret not in everything and "TESTSECRET" not in everything
    env, _ = doctor_json(tmp_path, XDG_CACHE_HOME="", HOME=str(tmp_path / "home"))
    real(env)
    assert env.cache_dir == str(tmp_path / "home" / ".cache" / "tpu-agent")
    assert env.anthropic_api_key_set is False


def test_doctor_text(tmp_path: Path) -> None:
    """The text report, with an API key set (never printed) and one without (the JSON test above)."""
    import torch

    secret = "sk-ant-api03-TESTSECRET-0123456789abcdef"
    proc = run_tool("doctor", cwd=tmp_path, env=clean_env(TPU_AGENT_CACHE_DIR=str(tmp_path / "c"),
                                                            ANTHROPIC_API_KEY=secret))
    assert proc.returncode == 0, proc.stderr
    assert "TESTSECRET" not in proc.stdout + proc.stderr
    rows = dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in proc.stdout.splitlines() if line.strip())
    assert rows["torch"] == torch.__version__
    assert rows["jax"] == importlib.metadata.version("jax")
    assert rows["jaxlib"] == importlib.metadata.version("jaxlib")
    assert rows["python"].startswith(platform.python_version())
    assert rows["ANTHROPIC_API_KEY set"] == "yes"
    assert rows["cache dir"] == str(tmp_path / "c")
    assert rows["runs dir"] == str(tmp_path / ".tpu-agent" / "runs")
    assert rows["torch_tpu (Google)"] in {"importable", "not installed"}
    assert "jax platform" in rows and "jax devices" in rows
    assert "not calibrated yet" in proc.stdout  # an empty cache directory: no peak measured (test_profile_cli.py)


# ------------------------------------------------------------------ bad input: one line, exit 2


@pytest.mark.parametrize("argv, said", [
    (["frobnicate"], "frobnicate"),  # an unknown command
    (["doctor", "--jsn"], "--json"),  # an unknown option: the suggestion
    (["run"], "SCRIPT"),  # the script argument missing
])
def test_unknown_command_or_option_and_missing_script(tmp_path: Path, argv: list[str], said: str) -> None:
    proc = run_tool(*argv, cwd=tmp_path)
    assert proc.returncode == 2
    assert said in one_error_line(proc)


def test_nonexistent_script(tmp_path: Path) -> None:
    proc = run_tool("run", "nope.py", cwd=tmp_path)
    assert proc.returncode == 2
    assert one_error_line(proc) == "error: script not found: nope.py"
    assert not (tmp_path / ".tpu-agent").exists()


def test_directory_is_not_a_script(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    proc = run_tool("run", "pkg", cwd=tmp_path)
    assert proc.returncode == 2
    assert one_error_line(proc) == "error: not a file: pkg"


def test_syntax_error_names_the_line(tmp_path: Path) -> None:
    write(tmp_path / "bad.py", """\
        print("this must not run")
        def f(x):
            return x +
        """)
    proc = run_tool("run", "bad.py", cwd=tmp_path)
    assert proc.returncode == 2
    assert re.fullmatch(r"error: syntax error in bad\.py line 3: .+", one_error_line(proc))
    assert not (tmp_path / ".tpu-agent").exists()


@pytest.mark.parametrize("command", ["run", "knobs", "tune", "profile"])
def test_source_that_python_cannot_decode_is_refused_as_python_refuses_it(tmp_path: Path, command: str) -> None:
    (tmp_path / "latin.py").write_bytes(b"print('this must not run')\nx = 1  # caf\xe9\n")
    proc = run_tool(command, "latin.py", cwd=tmp_path)
    assert proc.returncode == 2
    assert one_error_line(proc) == ("error: latin.py line 2 is not valid utf-8: byte 0xe9 (save it as UTF-8, or "
                                    "declare its encoding on the first line, e.g. `# -*- coding: latin-1 -*-`)")
    assert not (tmp_path / ".tpu-agent").exists()
    (tmp_path / "declared.py").write_bytes(b"# -*- coding: latin-1 -*-\nprint('caf\xe9')\n")
    if command == "run":
        ok = run_tool("run", "-q", "declared.py", cwd=tmp_path)
        assert ok.returncode == 0 and ok.stdout == "caf\u00e9\n", ok.stderr


def test_a_plan_from_a_newer_tpu_agent_is_refused(tmp_path: Path) -> None:
    (tmp_path / "ok.py").write_text("print('must not run')\n")
    (tmp_path / "plan.json").write_text('{"schema_version": 99, "actions": []}')
    proc = run_tool("run", "ok.py", "--plan", "plan.json", cwd=tmp_path)
    assert proc.returncode == 2
    assert one_error_line(proc) == ("error: plan plan.json has schema_version 99, newer than this tpu-agent reads "
                                    "(1); upgrade tpu-agent or make the plan again")


def test_script_option_before_separator_gets_a_hint(tmp_path: Path) -> None:
    write(tmp_path / "ok.py", "print('ran')\n")
    proc = run_tool("run", "ok.py", "--steps", "3", cwd=tmp_path)
    assert proc.returncode == 2
    line = one_error_line(proc)
    assert "--steps" in line and "'--'" in line


# ------------------------------------------------------------------ run


CRASH = """\
    import sys

    def inner():
        raise ValueError("boom from the user's code")

    def outer():
        inner()

    print("before the crash", flush=True)
    try:
        {}["missing"]
    except KeyError:
        outer()
    """


def test_crash_shows_the_users_own_traceback(tmp_path: Path) -> None:
    write(tmp_path / "crash.py", CRASH)
    proc = run_tool("run", "-q", "crash.py", cwd=tmp_path)
    direct = run_python("crash.py", cwd=tmp_path)
    assert direct.returncode == 1
    assert proc.returncode == 1
    assert proc.stdout == "before the crash\n"
    # Same traceback, chained exception included, as plain python prints it.
    assert proc.stderr == direct.stderr
    assert "ValueError: boom from the user's code" in proc.stderr
    assert "runpy" not in proc.stderr and "tpu_agent" not in proc.stderr


@pytest.mark.parametrize(
    ("body", "code", "stderr"),
    [
        ("import sys\nsys.exit(7)\n", 7, ""),
        ("import sys\nsys.exit('fatal: no data')\n", 1, "fatal: no data\n"),
        ("raise SystemExit(0)\n", 0, ""),
    ],
)
def test_script_exit_code_propagates(tmp_path: Path, body: str, code: int, stderr: str) -> None:
    write(tmp_path / "exits.py", body)
    proc = run_tool("run", "--quiet", "exits.py", cwd=tmp_path)
    assert proc.returncode == code
    assert proc.stderr == stderr


SHOW = """\
    import json, os, sys
    print(json.dumps({
        "argv": sys.argv[1:],
        "argv0": os.path.realpath(sys.argv[0]),
        "file": __file__,
        "cwd": os.getcwd(),
        "path0": sys.path[0],
        "cwd_on_path": os.getcwd() in sys.path or "" in sys.path,
        "name": __name__,
        "torch_loaded": "torch" in sys.modules,
        "run_dir": os.environ.get("{RUN_DIR_ENV}"),
    }))
    sys.exit(3)
    """


def test_run_passes_argv_cwd_and_path_through_and_records_the_run_with_a_summary_line(tmp_path: Path) -> None:
    """One run (not quiet) of a script that shows what it was given and exits 3, beside plain python's: argv, cwd,
    sys.path[0], __file__ and __name__ as python gives them, torch imported before it; its exit code; the one run
    directory, told to the child, its run.json (exit code, args, script, cwd, duration) and the summary line."""
    write(tmp_path / "scripts" / "show.py", SHOW.replace("{RUN_DIR_ENV}", RUN_DIR_ENV))
    workdir = tmp_path / "work"
    workdir.mkdir()
    args = ["--flag", "value", "--", "x", "with space", ""]
    proc = run_tool("run", "../scripts/show.py", "--", *args, cwd=workdir)
    direct = run_python("../scripts/show.py", *args, cwd=workdir)
    assert proc.returncode == 3 and direct.returncode == 3, proc.stderr + direct.stderr
    ours, theirs = json.loads(proc.stdout), json.loads(direct.stdout)
    assert ours["argv"] == args
    assert ours["cwd"] == str(workdir)
    assert ours["path0"] == str(tmp_path / "scripts")
    assert ours["torch_loaded"] is True  # imported before the script, as the device needs
    for key in ("argv", "argv0", "file", "cwd", "path0", "cwd_on_path", "name"):
        assert ours[key] == theirs[key], key

    runs = list((workdir / ".tpu-agent" / "runs").iterdir())
    assert len(runs) == 1 and re.fullmatch(r"\d{8}-\d{6}-show", runs[0].name)
    result = RunResult.model_validate_json((runs[0] / "run.json").read_text())
    assert result.exit_code == 3 and not result.ok
    assert result.args == args
    assert result.script == str(tmp_path / "scripts" / "show.py")
    assert result.cwd == str(workdir)
    assert result.duration_s > 0
    assert Path(result.run_dir) == runs[0]
    assert ours["run_dir"] == str(runs[0])  # the child was told its run dir
    summary = proc.stderr.strip().splitlines()[-1]
    assert "exit 3" in summary and str(runs[0].relative_to(workdir)) in summary


def test_doctor_reports_a_broken_jax_instead_of_crashing(tmp_path: Path) -> None:
    fake = tmp_path / "shadow" / "jax"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('simulated broken jax')\n")
    env = clean_env(PYTHONPATH=str(tmp_path / "shadow"))
    proc = run_tool("doctor", cwd=tmp_path, env=env)
    assert proc.returncode == 1
    assert "problem: import jax failed: ImportError: simulated broken jax" in proc.stdout
    assert "Traceback" not in proc.stderr
    proc = run_tool("doctor", "--json", cwd=tmp_path, env=env)
    assert proc.returncode == 1
    report = Environment.model_validate_json(proc.stdout)
    assert report.jax_devices == [] and report.jax_default_backend is None
    assert report.problems == ["import jax failed: ImportError: simulated broken jax"]


def test_run_with_a_source_plan_makes_one_run_directory_and_names_the_users_script(tmp_path: Path) -> None:
    write(tmp_path / "train.py", "WIDTH = 30\nprint('width', WIDTH)\n")
    plan = {"actions": [{"kind": "pad_dim", "file": "train.py", "line": 1, "column": 8, "old": 30, "new": 32}]}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    proc = run_tool("run", "train.py", "--plan", "plan.json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "width 32\n"
    runs = [p for p in (tmp_path / ".tpu-agent" / "runs").iterdir() if p.is_dir()]
    assert len(runs) == 1, runs
    assert (runs[0] / "workspace").is_dir() and (runs[0] / "run.json").is_file()
    summary = proc.stderr.strip().splitlines()[-1]
    assert summary.startswith("tpu-agent: train.py with plan plan.json exit 0"), summary
    assert "workspace" not in summary.split(";")[0]
    assert (tmp_path / "train.py").read_text() == "WIDTH = 30\nprint('width', WIDTH)\n"  # the user's file untouched
