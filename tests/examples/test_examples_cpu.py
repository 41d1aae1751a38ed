"""The example scripts train on the CPU today, and keep the contracts later tools rely on."""

from __future__ import annotations

import ast
import math
import re
from pathlib import Path

import pytest

from support.paths import EXAMPLES
from support.processes import run_python, run_tool

pytestmark = pytest.mark.slow  # whole tunes or every example, end to end

STEP_LINE = re.compile(r"step=(\d+) loss=(-?\d+\.\d{6}|nan|inf|-inf)")
EXAMPLE_NAMES = ["mlp", "odd_shapes", "cnn", "transformer"]


def losses(stdout: str, steps: int) -> list[float]:
    lines = stdout.splitlines()
    assert len(lines) == steps, f"expected {steps} lines on stdout, got:\n{stdout}"
    values = []
    for i, line in enumerate(lines):
        m = STEP_LINE.fullmatch(line)
        assert m, f"malformed step line: {line!r}"
        assert int(m.group(1)) == i
        value = float(m.group(2))
        assert math.isfinite(value), line
        values.append(value)
    return values


@pytest.mark.parametrize("name", EXAMPLE_NAMES)
def test_example_runs_three_steps_on_cpu(name: str, tmp_path: Path) -> None:
    proc = run_python(str(EXAMPLES / f"{name}.py"), "--device", "cpu", "--steps", "3", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    values = losses(proc.stdout, 3)
    assert all(v > 0 for v in values)


def test_mlp_is_seeded_and_learns(tmp_path: Path) -> None:
    script = str(EXAMPLES / "mlp.py")
    a = losses(run_python(script, "--device", "cpu", "--steps", "10", cwd=tmp_path).stdout, 10)
    b = losses(run_python(script, "--device", "cpu", "--steps", "10", cwd=tmp_path).stdout, 10)
    c = losses(run_python(script, "--device", "cpu", "--steps", "10", "--seed", "1", cwd=tmp_path).stdout, 10)
    assert a == b, "same seed, different losses"
    assert a != c, "the seed has no effect"
    assert a[-1] < a[0] - 0.1, f"loss did not fall: {a[0]} -> {a[-1]}"


def test_tpu_agent_run_reproduces_plain_python(tmp_path: Path) -> None:
    args = ["--device", "cpu", "--steps", "3"]
    direct = run_python(str(EXAMPLES / "mlp.py"), *args, cwd=tmp_path)
    ours = run_tool("run", "-q", str(EXAMPLES / "mlp.py"), "--", *args, cwd=tmp_path)
    assert ours.returncode == 0, ours.stderr
    assert ours.stdout == direct.stdout
    losses(ours.stdout, 3)


@pytest.mark.parametrize("name", EXAMPLE_NAMES)
def test_device_defaults_to_tpu(name: str) -> None:
    tree = ast.parse((EXAMPLES / f"{name}.py").read_text())
    defaults = {
        node.args[0].value: kw.value.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument"
        for kw in node.keywords
        if kw.arg == "default"
    }
    assert defaults["--device"] == "tpu"
    assert defaults["--steps"] == 20
    assert defaults["--seed"] == 0


# The padding tool rewrites these module-level integer literals; they must be
# plain literals, and the programs must still run with every one of them padded.
PADDABLE = {
    "odd_shapes": {"BATCH": 50, "WIDTH": 63, "WIDE": 127, "HIDDEN": 255},
    "transformer": {"VOCAB": 50257},
}


def module_int_literals(source: str) -> dict[str, int]:
    out = {}
    for node in ast.parse(source).body:
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, ast.Constant)
            and type(node.value.value) is int
        ):
            out[node.targets[0].id] = node.value.value
    return out


@pytest.mark.parametrize("name", sorted(PADDABLE))
def test_sizes_are_literals_that_flow_into_shapes(name: str, tmp_path: Path) -> None:
    source = (EXAMPLES / f"{name}.py").read_text()
    literals = module_int_literals(source)
    for var, value in PADDABLE[name].items():
        assert literals.get(var) == value, f"{name}.py: {var} should be the literal {value}"
        padded = -(-value // 128) * 128
        source, n = re.subn(rf"^{var} = {value}\b", f"{var} = {padded}", source, flags=re.M)
        assert n == 1
    padded_script = tmp_path / f"{name}_padded.py"
    padded_script.write_text(source)
    proc = run_python(str(padded_script), "--device", "cpu", "--steps", "2", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    losses(proc.stdout, 2)
