"""`[tool.tpu-agent]` in the user's pyproject.toml: defaults for tune; flags win; typos are errors."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tpu_agent.config import TuneOptions, find_pyproject, resolve
from tpu_agent.errors import InputError


def project(root: Path, table: str | None, *, sub: str = "src/train") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    if table is not None:
        (root / "pyproject.toml").write_text(textwrap.dedent(table))
    script = root / sub / "train.py"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text("print('hi')\n")
    return script


def test_defaults_without_a_pyproject(tmp_path: Path) -> None:
    script = project(tmp_path / "p", None)
    if find_pyproject(script.parent) is not None:
        pytest.skip("a pyproject.toml with [tool.tpu-agent] sits above the temp dir")
    r = resolve(script)
    assert r.options == TuneOptions()
    assert r.pyproject is None and set(r.sources.values()) == {"default"}


def test_pyproject_defaults_found_upward_and_flags_win(tmp_path: Path) -> None:
    script = project(tmp_path / "repo", """\
        [project]
        name = "x"

        [tool.tpu-agent]
        trials = 40
        min-gain = 0.05
        loss_tol = 0.01
        target = "v5e"
        storage = "sqlite:///studies.db"
        """)
    r = resolve(script, {"trials": 7, "seed": None, "objective": "both"})
    o = r.options
    assert (o.trials, o.min_gain, o.loss_tol, o.target, o.storage, o.objective, o.seed) == (
        7, 0.05, 0.01, "v5e", "sqlite:///studies.db", "both", 0)
    assert r.sources["trials"] == "flag" and r.sources["min_gain"] == "pyproject"
    assert r.sources["objective"] == "flag" and r.sources["seed"] == "default"  # None means "not given"
    assert r.pyproject == str((tmp_path / "repo" / "pyproject.toml").resolve())


def test_nearest_pyproject_with_the_table_is_used(tmp_path: Path) -> None:
    script = project(tmp_path / "repo", "[tool.tpu-agent]\ntrials = 11\n", sub="pkg")
    (script.parent / "pyproject.toml").write_text('[project]\nname = "pkg"\n')  # no table: keep looking up
    assert resolve(script).options.trials == 11
    (script.parent / "pyproject.toml").write_text('[tool.tpu-agent]\ntrials = 3\n')
    assert resolve(script).options.trials == 3


@pytest.mark.parametrize(
    "table,message",
    [
        ("trails = 3", "unknown key 'trails' in [tool.tpu-agent]; did you mean 'trials'?"),
        ("frobnicate = 1", "unknown key 'frobnicate' in [tool.tpu-agent] (known keys: allow, apply, "),
        ("trials = '20'", "[tool.tpu-agent] trials: Input should be a valid integer (got '20')"),
        ("objective = 'speed'", "[tool.tpu-agent] objective: Input should be 'time', 'memory' or 'both'"),
        ("min-gain = -0.1", "[tool.tpu-agent] min-gain: Input should be greater than or equal to 0"),
        ("pairs = 3", "[tool.tpu-agent] pairs: Input should be greater than or equal to 5"),
        ("trials = 3\ntrials_ = 4", "unknown key 'trials_'"),
        ("min-gain = 0.1\nmin_gain = 0.2", "sets 'min-gain' twice"),
        ("trials = [", "invalid TOML"),
    ],
)
def test_bad_table_is_one_clear_input_error(tmp_path: Path, table: str, message: str) -> None:
    script = project(tmp_path / "repo", f"[tool.tpu-agent]\n{table}\n")
    with pytest.raises(InputError) as info:
        resolve(script)
    assert message in str(info.value)
    assert str(tmp_path / "repo" / "pyproject.toml") in str(info.value)
    assert info.value.exit_code == 2 and "\n" not in str(info.value)


def test_a_bad_flag_value_names_the_flag(tmp_path: Path) -> None:
    script = project(tmp_path / "repo", "[tool.tpu-agent]\ntrials = 3\n")
    with pytest.raises(InputError, match=r"^--loss-tol: Input should be less than 1"):
        resolve(script, {"loss_tol": 2.0})


def test_unknown_flag_name_is_a_programming_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a tune option: trails"):
        resolve(project(tmp_path / "repo", None), {"trails": 3})


def test_playbooks_as_one_folder_resolve_against_the_pyproject_not_the_cwd(tmp_path: Path, monkeypatch) -> None:
    script = project(tmp_path / "repo", '[tool.tpu-agent]\nplaybooks = "tuning"\noutput-dir = "out"\n')
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    o = resolve(script, {"playbooks": ["mine"]}).options
    assert o.playbooks == [str((tmp_path / "repo" / "tuning").resolve()), str((tmp_path / "elsewhere" / "mine").resolve())]
    assert o.runs_root() == (tmp_path / "repo" / "out").resolve()
    bad = project(tmp_path / "bad", "[tool.tpu-agent]\nplaybooks = 3\n")
    with pytest.raises(InputError, match="playbooks: must be a directory or a list of directories"):
        resolve(bad)


def test_steps_below_five_are_refused_not_clamped(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"^--steps: Input should be greater than or equal to 5"):
        resolve(project(tmp_path / "repo", None), {"steps": 3})


def test_allow_opens_model_and_training_never_the_data(tmp_path: Path) -> None:
    script = project(tmp_path / "repo", '[tool.tpu-agent]\nallow = "training, model"\n')
    assert resolve(script).options.allow == ["model", "training"]
    with pytest.raises(InputError) as info:
        resolve(script, {"allow": "model,data"})
    assert str(info.value) == "--allow: data is never changed by the tuner (allow takes model, training) (got 'model,data')"


def test_every_option_is_a_tune_flag_with_the_help_and_default_it_declares() -> None:
    """One declaration per option (config.TuneOptions): `tune --help` shows its text and its default, the flag
    is its name with dashes, and a flag not given is None (so [tool.tpu-agent], then the default, applies)."""
    import typer
    from typer.testing import CliRunner

    from tpu_agent.cli.app import app

    params = {p.name: p for p in typer.main.get_command(app).commands["tune"].params}
    cli_only = {"script", "script_args", "offline", "json_output", "device_map"}
    assert set(params) - cli_only == set(TuneOptions.model_fields)
    for name in TuneOptions.model_fields:
        assert params[name].opts[0] == "--" + name.replace("_", "-") and params[name].default is None, name
    assert params["output_dir"].opts == ["--output-dir", "-o"] and params["resume"].secondary_opts == []

    shown = CliRunner().invoke(app, ["tune", "--help"], env={"COLUMNS": "400"}, terminal_width=400).output
    lines = {line.split()[1]: " ".join(line.split()) for line in shown.splitlines() if line.startswith("│ --")}
    for name, field in TuneOptions.model_fields.items():
        assert field.description in lines["--" + name.replace("_", "-")], name
    expected = {"--trials": "[default: 20]", "--trial-timeout": "[default: 600]", "--min-gain": "[default: 0.03]",
                "--token-budget": "[default: 200000]", "--target": "[default: cpu]",
                "--allow": "[default: exact and numerics only]", "--playbooks": "[tool.tpu-agent]"}
    for flag, text in expected.items():
        assert text in lines[flag], (flag, lines[flag])
    assert "default:" not in lines["--timeout"] and "default:" not in lines["--resume"]
