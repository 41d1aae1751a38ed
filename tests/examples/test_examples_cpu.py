"""The example scripts train on the CPU today, and keep the contracts later tools rely on."""

from __future__ import annotations

import ast
import json
import math
import re
from pathlib import Path

import pytest

from support.examples import RUN_EACH
from support.paths import EXAMPLES
from support.processes import run_python, run_tool

pytestmark = pytest.mark.slow  # whole tunes or every example, end to end

STEP_LINE = re.compile(r"step=(\d+) loss=(-?\d+\.\d{6}|nan|inf|-inf)")
EXAMPLE_NAMES = ["mlp", "odd_shapes", "odd_mlp", "cnn", "transformer"]


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


# The examples' CPU runs, one after the other in one Python process (support/examples.py's RUN_EACH: one start-up
# of Python and torch for all), each as `python example.py ARGS` would run it. A later run starts from the torch RNG
# state an earlier one left: a script that did not seed itself would show.
def run_each(runs: list[list[str]], cwd: Path) -> list[str]:
    """Each run's stdout (a run is a script and its arguments)."""
    proc = run_python("-c", RUN_EACH, json.dumps(runs), cwd=cwd, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_every_example_trains_on_cpu_seeded_padded_and_under_the_tool(tmp_path: Path) -> None:
    """Each example runs three steps on the CPU, printing one well-formed, positive loss a step; the ones with
    paddable sizes run with every size padded to a multiple of 128 (the rewrite the padding tool makes); mlp.py
    is seeded (the same seed gives the same losses, another seed others) and learns in 10 steps; and `tpu-agent
    run` prints exactly what plain python prints for it."""
    mlp = str(EXAMPLES / "mlp.py")
    cpu = ["--device", "cpu"]
    padded = {name: padded_script(name, tmp_path) for name in sorted(PADDABLE)}
    runs = {**{name: [str(EXAMPLES / f"{name}.py"), *cpu, "--steps", "3"] for name in EXAMPLE_NAMES},
            **{f"{name} padded": [str(script), *cpu, "--steps", "2"] for name, script in padded.items()},
            "mlp a": [mlp, *cpu, "--steps", "10"], "mlp b": [mlp, *cpu, "--steps", "10"],
            "mlp seed 1": [mlp, *cpu, "--steps", "10", "--seed", "1"]}
    printed = dict(zip(runs, run_each(list(runs.values()), tmp_path)))
    for name in EXAMPLE_NAMES:
        assert all(v > 0 for v in losses(printed[name], 3)), name
    for name in padded:
        losses(printed[f"{name} padded"], 2)
    a, b, c = (losses(printed[k], 10) for k in ("mlp a", "mlp b", "mlp seed 1"))
    assert a == b, "same seed, different losses"
    assert a != c, "the seed has no effect"
    assert a[-1] < a[0] - 0.1, f"loss did not fall: {a[0]} -> {a[-1]}"

    ours = run_tool("run", "-q", mlp, "--", *cpu, "--steps", "3", cwd=tmp_path)
    assert ours.returncode == 0, ours.stderr
    assert ours.stdout == printed["mlp"]
    losses(ours.stdout, 3)


@pytest.mark.parametrize("name", EXAMPLE_NAMES)
def test_device_defaults_to_tpu(name: str) -> None:
    """The defaults the example's command line declares, its own and those of the loop it imports."""
    source = (EXAMPLES / f"{name}.py").read_text()
    assert "from training import arguments, train" in source  # the loop the single-device examples share
    defaults = {
        node.args[0].value: kw.value.value
        for text in (source, (EXAMPLES / "training.py").read_text())
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument"
        for kw in node.keywords
        if kw.arg == "default" and isinstance(kw.value, ast.Constant)  # not training.py's `default=lr`
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


def padded_script(name: str, folder: Path) -> Path:
    """A copy of the example with each of its PADDABLE literals padded to a multiple of 128."""
    source = (EXAMPLES / f"{name}.py").read_text()
    for var, value in PADDABLE[name].items():
        padded = -(-value // 128) * 128
        source, n = re.subn(rf"^{var} = {value}\b", f"{var} = {padded}", source, flags=re.M)
        assert n == 1, (name, var)
    path = folder / f"{name}_padded.py"
    path.write_text(source)
    (folder / "training.py").write_text((EXAMPLES / "training.py").read_text())  # the loop it imports, beside it
    return path


@pytest.mark.parametrize("name", sorted(PADDABLE))
def test_sizes_are_literals_that_flow_into_shapes(name: str, tmp_path: Path) -> None:
    """Plain module-level literals, each rewritten once in the padded copy (which runs in
    test_every_example_trains_on_cpu_seeded_padded_and_under_the_tool)."""
    literals = module_int_literals((EXAMPLES / f"{name}.py").read_text())
    for var, value in PADDABLE[name].items():
        assert literals.get(var) == value, f"{name}.py: {var} should be the literal {value}"
    padded = module_int_literals(padded_script(name, tmp_path).read_text())
    for var, value in PADDABLE[name].items():
        assert padded[var] == -(-value // 128) * 128, (var, padded[var])
