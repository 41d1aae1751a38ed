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


def test_tune_nproc_one_is_one_rank_of_a_torchrun_job(tmp_path, monkeypatch):
    """Given (a flag or [tool.tpu-agent]), --nproc 1 makes every process the tune launches one rank with torchrun's
    variables, as run and profile do; not given, the script runs as python runs it. Both measure one process."""
    from tpu_agent import envvars

    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    default, one, two = (resolve(script, flags) for flags in ({}, {"nproc": 1}, {"nproc": 2}))
    assert default.options.nproc == one.options.nproc == 1 and two.options.nproc == 2
    assert one.sources["nproc"] == "flag" and default.sources["nproc"] == "default"

    seen = []

    class Stop(Exception):
        pass

    def tune(*args, **kwargs):
        seen.append((kwargs.get("proposer"), envvars.ONE_RANK.read(), args[2].nproc))
        raise Stop

    monkeypatch.setattr("tpu_agent.pipeline.tune", tune)
    monkeypatch.chdir(tmp_path)
    for flags in ([], ["--nproc", "1"]):
        assert isinstance(invoke("tune", str(script), "--offline", *flags).exception, Stop)
    (tmp_path / "pyproject.toml").write_text("[tool.tpu-agent]\nnproc = 1\n")
    assert isinstance(invoke("tune", str(script), "--offline").exception, Stop)
    assert [(marked, nproc) for _, marked, nproc in seen] == [(False, 1), (True, 1), (True, 1)]
    assert not envvars.ONE_RANK.read()  # the tune's own environment is left as it was
    assert "--nproc" in refusal(invoke("tune", str(script), "--nproc", "0"))


def test_each_one_rank_child_gets_its_own_port(monkeypatch):
    """What launch gives a child under TPU_AGENT_ONE_RANK=1: a group of one, a MASTER_PORT per child, and the
    marker itself left out of the script's environment; nothing at N ranks (torchrun sets its own) or unmarked."""
    from tpu_agent import envvars
    from tpu_agent.run import launch

    envs = []
    monkeypatch.setattr(launch.subprocess, "Popen", lambda command, **kw: envs.append(kw["env"]))
    marked = {"PATH": "/bin", envvars.ONE_RANK.name: "1"}
    launch.launch("train.py", [], env=marked)
    launch.launch("train.py", [], env=marked)
    launch.launch("train.py", [], env=marked, nproc=2)
    launch.launch("train.py", [], env={"PATH": "/bin"})
    first, second, ranks, plain = envs
    for env in (first, second):
        assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")} == {
            "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    assert first["MASTER_PORT"] != second["MASTER_PORT"]
    assert all(envvars.ONE_RANK.name not in env for env in envs)
    assert "RANK" not in ranks and "MASTER_PORT" not in ranks and plain == {"PATH": "/bin"}


def test_one_rank_is_another_study(tmp_path, monkeypatch):
    """A torchrun rank of one runs another program than the script as python runs it: the study's fingerprint and
    the key a joining worker must match both tell them apart (and a worker joining without --nproc 1 is refused)."""
    from tpu_agent import envvars
    from tpu_agent.search.study import _differs, worker_key

    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    options = TuneOptions()
    plain, plain_key = options.fingerprint(script, []), worker_key(script, [], options)
    monkeypatch.setenv(envvars.ONE_RANK.name, "1")
    ranked, ranked_key = options.fingerprint(script, []), worker_key(script, [], options)
    assert plain != ranked and plain_key["settings"]["nproc"] is None and ranked_key["settings"]["nproc"] == 1
    assert _differs(ranked_key, plain_key) == "it was made for another search space: --nproc 1, here None"
    assert _differs(plain_key, ranked_key) == "it was made for another search space: --nproc None, here 1"
