"""--nproc, --warmup, --target and --output-dir: declared once (config.SHARED), the same flag in every command
that takes it; checked through typer's own commands and in-process invocations (no child process runs)."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from tpu_agent.cli.app import app
from tpu_agent.config import SHARED, TuneOptions, resolve

TAKES = {"nproc": ("run", "profile", "tune"), "warmup": ("profile", "tune"), "target": ("profile", "tune"),
         "output_dir": ("profile", "tune")}


def params(command: str) -> dict:
    return {p.name: p for p in typer.main.get_command(app).commands[command].params}


@pytest.mark.parametrize("name", sorted(SHARED))
def test_one_help_and_one_bound_in_every_command(name):
    declared = SHARED[name]
    flags = {command: params(command)[name] for command in TAKES[name]}
    helps = {flag.help for flag in flags.values()}
    assert len(helps) == 1 and declared.help in helps.pop()
    assert {tuple(flag.opts) for flag in flags.values()} == {(f"--{name.replace('_', '-')}",
                                                             *([declared.short] if declared.short else []))}
    assert {flag.metavar for flag in flags.values()} == {declared.metavar}
    for command, flag in flags.items():  # click's bound where click checks it; pydantic's for tune
        low = flag.min
        assert low == (declared.ge if command != "tune" else None), (command, name)
    bound = [m.ge for m in TuneOptions.model_fields[name].metadata if hasattr(m, "ge")]
    assert bound == ([declared.ge] if declared.ge is not None else [])
    assert TuneOptions.model_fields[name].description == declared.help
    if "profile" in flags and name != "target":  # profile's default is the declaration's (target: a str, not None)
        assert flags["profile"].default == declared.default


def test_profile_warmup_default_is_the_profilers():
    from tpu_agent.profilers.schema import Settings

    assert Settings.model_fields["warmup"].default == SHARED["warmup"].default


@pytest.fixture
def captured(monkeypatch):
    """profile's settings and nproc as the command line made them; nothing runs."""
    seen = {}

    def profile_script(script, args, **kwargs):
        seen.update(kwargs)
        return 0

    monkeypatch.setattr("tpu_agent.cli.profile.profile_script", profile_script)
    return seen


def invoke(*args):
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})


def refusal(result) -> str:
    """The one line a refused command line ends with: click's usage error (exit 2), or the InputError that
    `tpu-agent`'s main turns into exit 2 (in process it is the exception)."""
    from tpu_agent.errors import InputError

    if isinstance(result.exception, InputError):
        return str(result.exception)
    assert result.exit_code == 2, (result.exit_code, result.output)
    return result.output


@pytest.mark.parametrize(("target", "generation"), [("v5e-8", "v5e"), ("v6e-256", "v6e"), ("tpu7x-4x4x4", "v7x"),
                                                    ("2xv5e-4", "v5e"), ("v5p", "v5p"), ("cpu", None)])
def test_profile_target_takes_a_slice_or_a_generation(tmp_path, captured, target, generation):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    result = invoke("profile", str(script), "--target", target)
    assert result.exit_code == 0, result.output
    assert captured["settings"].target == generation
    assert TuneOptions(target=target).generation == (generation or "cpu")  # tune reads it the same way


def test_profile_without_target_estimates_nothing(tmp_path, captured):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    assert invoke("profile", str(script)).exit_code == 0
    assert captured["settings"].target is None and captured["nproc"] is None
    assert invoke("profile", str(script), "--nproc", "1", "--warmup", "1").exit_code == 0
    assert captured["nproc"] == 1 and captured["settings"].warmup == 1


@pytest.mark.parametrize("command", ["profile", "tune"])
def test_warmup_below_one_is_refused_by_every_command(tmp_path, captured, command):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    for bad in ("0", "-1"):
        assert "--warmup" in refusal(invoke(command, str(script), "--warmup", bad))
    assert not captured  # nothing was profiled


@pytest.mark.parametrize("command", ["profile", "tune"])
def test_unknown_target_is_refused_by_every_command(tmp_path, captured, command):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    assert "--target" in refusal(invoke(command, str(script), "--target", "v9-8"))


def test_pyproject_warmup_zero_is_refused(tmp_path):
    from tpu_agent.errors import InputError

    (tmp_path / "pyproject.toml").write_text("[tool.tpu-agent]\nwarmup = 0\n")
    (tmp_path / "train.py").write_text("print('hi')\n")
    with pytest.raises(InputError, match=r"\[tool.tpu-agent\] warmup: Input should be greater than or equal to 1"):
        resolve(tmp_path / "train.py")


def test_tune_nproc_one_is_its_single_process(tmp_path):
    """tune keeps one process as python runs it for --nproc 1 (its warm processes would share a MASTER_PORT): the
    same options and the same study as no --nproc; 2 is another study."""
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    default, one, two = (resolve(script, flags) for flags in ({}, {"nproc": 1}, {"nproc": 2}))
    assert default.options.nproc == one.options.nproc == 1 and two.options.nproc == 2
    assert one.sources["nproc"] == "flag" and default.sources["nproc"] == "default"
    assert default.options.fingerprint(script, []) == one.options.fingerprint(script, [])
    assert two.options.fingerprint(script, []) != one.options.fingerprint(script, [])
    assert "--nproc" in refusal(invoke("tune", str(script), "--nproc", "0"))
