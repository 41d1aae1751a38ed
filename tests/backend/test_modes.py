"""Fused and compiled execution: same losses as the CPU, one program per step, recompilations."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

from support.examples import EXTRA, STEPS, STEPS_FOR, fused_programs, losses, run_each
from support.paths import EXAMPLES as EXAMPLE_DIR

MODES = {
    "fused": ({"TORCH_TPU_DEFER_AND_FUSE": "1"}, []),
    # torch.compile of the step, then of the model: the example run twice in one process (one start-up of Python,
    # torch and JAX for both), each run with its own seed, model and optimizer
    "compiled step and model": ({}, [["--compile", "step"], ["--compile", "model"]]),
    "compiled steps": ({"TPU_AGENT_COMPILE_STEPS": "1"}, []),  # no change to the script
}


# The MLP (Linear, ReLU, cross-entropy, SGD) is a subset of the CNN (which adds convolutions, BatchNorm, pooling
# and SGD's momentum): its four modes run in the release matrix (`-m matrix`, docs/ci.md). So does the transformer
# under compiled steps, the longest case (its 50257-column LM head): compiled steps run on the other examples here
# and on the Hugging Face families (tests/backend/test_hf_models.py), the transformer in every other mode. The odd
# shapes' torch.compile of the step and of the model (the CNN's layers at sizes off every tile) is in the matrix too:
# the CNN and the transformer run both in the default pass, and the odd shapes every other mode.
EXAMPLES = [pytest.param("mlp", marks=pytest.mark.matrix), "odd_shapes", "cnn", "transformer"]
MATRIX_ONLY = {("transformer", "compiled steps"), ("odd_shapes", "compiled step and model")}


def _cases():
    for example in EXAMPLES:
        name = example.values[0] if hasattr(example, "values") else example
        for mode in MODES:
            marks = [*getattr(example, "marks", ()), *([pytest.mark.matrix] if (name, mode) in MATRIX_ONLY else [])]
            yield pytest.param(name, mode, marks=marks, id=f"{name}-{mode}")


@pytest.mark.parametrize("name, mode", list(_cases()))
def test_example_matches_cpu_in_fused_and_compiled_modes(name, mode, monkeypatch):
    cpu = losses(name, "cpu")
    env, extra = MODES[mode]
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if (name, mode) == ("transformer", "fused"):
        tpu, programs = fused_programs(name, *extra)
        transformer_runs_one_fused_program_per_step_without_recompiling(programs, len(cpu))
        runs = {mode: tpu}
    elif extra and isinstance(extra[0], list):
        runs = dict(zip((" ".join(e) for e in extra), _losses_in_one_process(name, extra)))
    else:
        runs = {mode: losses(name, "tpu", *extra)}
    for run, tpu in runs.items():
        assert len(tpu) == len(cpu), run
        for step, (a, b) in enumerate(zip(cpu, tpu)):
            assert b == pytest.approx(a, rel=1e-4), f"{run}, step {step}: cpu {a} tpu {b}"


def _losses_in_one_process(name: str, extras: list[list[str]]) -> list[list[float]]:
    """The example's per-step losses on tpu with each of `extras`, the runs one after the other in one process."""
    steps = STEPS_FOR.get(name, STEPS)
    argv = [str(EXAMPLE_DIR / f"{name}.py"), "--device", "tpu", "--steps", str(steps), *EXTRA.get(name, [])]
    printed = run_each([[*argv, *extra] for extra in extras])
    return [[float(v) for v in re.findall(r"^step=\d+ loss=(\S+)$", out, re.M)] for out in printed]


def transformer_runs_one_fused_program_per_step_without_recompiling(programs: dict, steps: int):
    # Warm-up (the optimizer creates its state in step 1) compiles one graph; the other steps reuse one more.
    assert len(programs["calls"]) == 2, programs
    assert programs["flushes"] == steps, programs  # one flush (one program run) per step
    assert programs["recompiles"] == 1, programs  # the steady graph is the only compile after the first


def run_python(code: str, **env) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                         timeout=600, env={**os.environ, **env})
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_a_batch_shape_change_in_the_last_step_is_one_recompilation_naming_the_shape():
    out = run_python("""
        import torch, torch.nn.functional as F
        from tpu_agent.backend.core import lazy
        torch.manual_seed(0)
        model = torch.nn.Linear(16, 4).to("tpu")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(6):
            batch = 8 if step < 5 else 5
            x = torch.randn(batch, 16).to("tpu")
            y = torch.randint(0, 4, (batch,)).to("tpu")
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        for r in lazy.RECORDER.recompiles:
            print("RECOMPILE", r.at_flush, r.changed_shapes)
    """, TORCH_TPU_DEFER_AND_FUSE="1")
    lines = [l for l in out.splitlines() if l.startswith("RECOMPILE")]
    assert len(lines) == 1, out
    assert "float32[5, 16]" in lines[0] and "int64[5]" in lines[0], lines[0]


def test_compiled_step_replays_one_program():
    out = run_python("""
        import torch, torch.nn.functional as F
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to("tpu")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randn(8, 16).to("tpu"); y = torch.randint(0, 4, (8,)).to("tpu")

        @torch.compile
        def step(x, y):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            return loss

        for _ in range(8):
            step(x, y)
        target = step._target
        print("REPLAYS", target.replays, "CAPTURES", target.captures, "REASON", target.reason_not_replayed)
    """)
    line = next(l for l in out.splitlines() if l.startswith("REPLAYS"))
    assert line.split()[1] == "5" and line.split()[3] == "3" and line.endswith("None"), line


def test_compiled_step_recaptures_when_the_learning_rate_changes():
    out = run_python("""
        import torch
        model = torch.nn.Linear(4, 1).to("tpu")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.ones(2, 4).to("tpu")

        @torch.tpu.compile
        def step(x):
            opt.zero_grad()
            loss = model(x).sum()
            loss.backward()
            opt.step()
            return loss

        for _ in range(4):
            step(x)
        before = model.weight.cpu().clone()
        opt.param_groups[0]["lr"] = 0.0
        step(x)
        print("UNCHANGED", torch.equal(before, model.weight.cpu()))
    """)
    assert "UNCHANGED True" in out, out


def test_a_loop_with_no_sync_point_flushes_at_the_size_limit_and_says_so():
    import torch

    from tpu_agent.backend.core.lazy import RECORDER, SIZE_LIMIT

    def grads(device, fused):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4).to(device)
        x = torch.randn(16, 8).to(device)
        mode = torch.tpu.EagerMode.DEFER_AND_FUSE if fused else torch.tpu.EagerMode.DEFER_NEVER
        with torch.tpu.set_eager_mode(mode):
            for _ in range(60):  # forward and backward, no optimizer step, no read: grads accumulate
                model(x).square().mean().backward()
        return model.weight.grad.cpu()

    old, RECORDER.max_ops = RECORDER.max_ops, 50  # not a multiple of the loop's op count: cuts would drift
    try:
        before, flushes, compiles = len(RECORDER.breaks), RECORDER.flushes, len(RECORDER.graphs)
        fused = grads("tpu", fused=True)
        limited = [b for b in RECORDER.breaks[before:] if b.reason == SIZE_LIMIT]
        ran = RECORDER.flushes - flushes
        graphs = len(RECORDER.graphs) - compiles
    finally:
        RECORDER.max_ops = old
    assert torch.allclose(fused, grads("cpu", fused=False), rtol=1e-5, atol=1e-6)
    assert len(limited) >= 10 and ran >= 10, (len(limited), ran)  # 60 steps x ~14 ops, cut every ~50
    # Each cut comes before the op the graph began with, so the loop's graphs repeat: the first, the
    # repeating one, and the tail at the final read, not one per drifting cut point.
    assert graphs <= 3, (graphs, ran)
    assert all(b.source and b.source.startswith("test_modes.py:") for b in limited), limited[:3]
