"""A plan with compiled steps on a model that cannot be one program (an MoE expert loop): the optimizer's
program gets gradients that fused work has not computed yet, and must run them first."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("transformers")

from support.paths import DATA  # noqa: E402
from support.processes import clean_env, run_python, run_tool  # noqa: E402

# Two runs of a small MoE, one compiling new shapes every step: in the release matrix (`-m matrix`, docs/ci.md).
# The default pass trains the same expert loop (Qwen3-MoE, transformers' "eager" experts) under compiled steps with
# operand padding to multiples of 8 against the CPU's losses, in-process (tests/backend/test_hf_models.py,
# compiled steps on qwen3_moe_loop); the plan's two actions reach the run child in tests/plan/test_apply.py.
pytestmark = [pytest.mark.slow, pytest.mark.matrix]


def losses(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"loss ([0-9.]+)", text)]


def test_compiled_steps_with_operand_padding_train_the_expert_loop_like_the_cpu(tmp_path):
    script = DATA / "scripts" / "moe_loop.py"
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"schema_version": 1, "actions": [{"kind": "pad_ops", "multiple": 8},
                                                                   {"kind": "compile", "mode": "compiled"}]}))
    cpu = run_python(str(script), "--device", "cpu", "--steps", "4", cwd=tmp_path, timeout=300)
    assert cpu.returncode == 0, cpu.stderr[-2000:]
    # before the fix: AttributeError: 'Lazy' object has no attribute 'sharding' in the optimizer's program
    tpu = run_tool("run", str(script), "--plan", str(plan), "--", "--steps", "4", cwd=tmp_path, env=clean_env(),
                   timeout=300)
    assert tpu.returncode == 0, tpu.stderr[-3000:]
    expected, actual = losses(cpu.stdout), losses(tpu.stdout)
    assert len(expected) == 1 and len(actual) == 1  # step 0; the crash came at the first optimizer step
    assert actual == pytest.approx(expected, rel=1e-3)  # the same math; compiled AdamW rounds in another order
