"""`tpu-agent project`: bad input is one line and exit 2; a run prints labelled, projected figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tpu_agent.cli.app import run_cli

TINY = str(Path(__file__).with_name("tiny_llama.py"))


@pytest.mark.parametrize("argv, words", [
    (["--target", "v5e-512"], "--target 'v5e-512': v5e offers slices of"),
    (["--target", "v5p-256", "--mesh", "data=16,fsdp=16"], "the mesh's product is 256, the slice has 128 chips"),
    (["--target", "tpu-9"], "--target 'tpu-9': expected a slice"),
])
def test_bad_input_is_one_line_and_exit_2(argv, words, capsys):
    assert run_cli(["project", TINY, *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err, err


def test_a_missing_script_is_named(capsys):
    assert run_cli(["project", "nowhere.py", "--target", "v6e-256"]) == 2
    assert capsys.readouterr().err == "error: script not found: nowhere.py\n"


def test_a_plan_rule_whose_dim_does_not_divide_names_it(tmp_path, capsys):
    plan = {"actions": [{"kind": "mesh", "axes": {"fsdp": 16}},
                        {"kind": "shard_rule", "pattern": "model.embed_tokens.weight", "spec": [None, "fsdp"]}]}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    code = run_cli(["project", TINY, "--target", "v5p-32", "--plan", str(tmp_path / "plan.json"), "--",
                    "--hidden", "72", "--steps", "4"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.strip().splitlines()[-1] == (
        "error: model.embed_tokens.weight: dim 1 of size 72 does not divide by mesh axis fsdp=16")


def test_a_projection_prints_labelled_figures_and_collectives_per_axis_and_per_chip_batch_sets_the_global_batch(
        tmp_path, capsys):
    """One projection (a trace of the tiny Llama: the suite's time) checks both: its labelled figures, collectives
    per axis, host offload and model FLOPs; and --per-chip-batch 3 on data=2 x fsdp=4, the step traced with 24
    sequences, not the script's 8 (the offloaded inputs and the FLOPs count 24)."""
    out = tmp_path / "projection.json"
    code = run_cli(["project", TINY, "--target", "v5p-16", "--mesh", "data=2,fsdp=4", "--offload-block-inputs",
                    "--per-chip-batch", "3", "--json", str(out), "--", "--steps", "4"])
    text = capsys.readouterr().out
    assert code == 0, text
    for label in ("memory per chip", "step time", "MFU", "communication", "assumptions:"):
        line = next(l for l in text.splitlines() if label in l)
        assert "projected for v5p-16" in line or label == "assumptions:", line
    assert "traced with 2 and 1 of the 3 repeated blocks (model.layers)" in text
    projection = json.loads(out.read_text())
    assert projection["chips"] == 8 and projection["fits"] is True
    # machine-readable: an estimate, with its assumptions, as the console says
    assert projection["estimate"] is True and projection["label"] == "projected for v5p-16"
    assert projection["assumptions"] and "generation's name, counting TensorCores" in projection["read_as"]
    # the 3 decoder layers' inputs (f32 hidden states, 24 x 32 tokens split over 8 chips) held in host memory
    assert projection["host_offload_bytes_per_chip"] == 3 * (24 * 32 // 8) * 64 * 4
    axes = {tuple(c["axes"]) for c in projection["collectives"] if c["kind"] != "collective-permute"}
    assert axes and axes <= {("data",), ("fsdp",), ("data", "fsdp")}
    # the model FLOPs: 3 x the forward matmuls, here the analytic 6 x matmul params x tokens + attention, over the
    # global batch of 3 per chip x 8 data-parallel chips (data x fsdp) = 24 sequences of 32 tokens
    tokens, hidden, inter, layers, vocab, kv = 24 * 32, 64, 128, 3, 256, 32
    matmul_params = layers * (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inter) + vocab * hidden
    attention = layers * 3 * 2 * 2 * 24 * 4 * 32 * 32 * 16  # 3 x (scores + weighted sum), 4 heads of 16
    assert projection["model_flops"] == pytest.approx(6 * matmul_params * tokens + attention)
    assert 0 < projection["mfu"] < 1 and projection["step_s"] > 0


FIXED = """
import torch
model = torch.nn.Linear(16, 16).to("tpu")
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(4):
    x = {batch}
    loss = model(x).view(8, 4, 4).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()
"""


@pytest.mark.parametrize("batch, words", [
    ('torch.randn(8, 16, device="tpu")', "its step fails with batch 8 made 16: RuntimeError"),
    ('torch.ones(8, 16, device="tpu")', "its step draws no batch on the device and moves none there"),
])
def test_per_chip_batch_on_a_script_whose_batch_cannot_change_is_one_line_and_exit_2(batch, words, tmp_path, capsys):
    script = tmp_path / "fixed.py"
    script.write_text(FIXED.format(batch=batch))
    code = run_cli(["project", str(script), "--target", "v5e-8", "--mesh", "data=8", "--per-chip-batch", "2"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("error: --per-chip-batch 2: the script's batch cannot be changed")
    assert words in err, err


def test_per_chip_batch_below_one_is_refused(capsys):
    assert run_cli(["project", TINY, "--target", "v5e-8", "--per-chip-batch", "0"]) == 2
    assert capsys.readouterr().err == "error: --per-chip-batch 0: give 1 or more sequences per chip\n"


def test_a_script_that_imports_its_own_module_projects(tmp_path, capsys):
    """The script's folder is on sys.path, as under `python train.py`: a sibling module imports (the examples share
    their loop in examples/training.py)."""
    (tmp_path / "shared_model.py").write_text(
        "import torch\n"
        "def build():\n"
        "    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))\n")
    (tmp_path / "train.py").write_text(
        "import torch\nfrom shared_model import build\n"
        "model = build().to('tpu')\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for _ in range(4):\n"
        "    loss = model(torch.randn(16, 64, device='tpu')).square().mean()\n"
        "    loss.backward(); opt.step(); opt.zero_grad()\n")
    code = run_cli(["project", str(tmp_path / "train.py"), "--target", "v5e-4"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "shared_model" not in err and "projected" in out, out + err
