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


def test_a_projection_prints_labelled_figures_and_collectives_per_axis(tmp_path, capsys):
    out = tmp_path / "projection.json"
    code = run_cli(["project", TINY, "--target", "v5p-16", "--mesh", "data=2,fsdp=4", "--json", str(out), "--",
                    "--steps", "4"])
    text = capsys.readouterr().out
    assert code == 0, text
    for label in ("memory per chip", "step time", "MFU", "communication", "assumptions:"):
        line = next(l for l in text.splitlines() if label in l)
        assert "projected for v5p-16" in line or label == "assumptions:", line
    assert "traced with 2 and 1 of the 3 repeated blocks (model.layers)" in text
    projection = json.loads(out.read_text())
    assert projection["chips"] == 8 and projection["fits"] is True
    axes = {tuple(c["axes"]) for c in projection["collectives"] if c["kind"] != "collective-permute"}
    assert axes and axes <= {("data",), ("fsdp",), ("data", "fsdp")}
    # the model FLOPs: 3 x the forward matmuls, here the analytic 6 x matmul params x tokens + attention
    tokens, hidden, inter, layers, vocab, kv = 8 * 32, 64, 128, 3, 256, 32
    matmul_params = layers * (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inter) + vocab * hidden
    attention = layers * 3 * 2 * 2 * 8 * 4 * 32 * 32 * 16  # 3 x (scores + weighted sum), 4 heads of 16
    assert projection["model_flops"] == pytest.approx(6 * matmul_params * tokens + attention)
    assert 0 < projection["mfu"] < 1 and projection["step_s"] > 0
