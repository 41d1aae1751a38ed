"""Knob discovery: which literals become tensor dims, where they are, what to try, how a profile ranks them."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from support.paths import EXAMPLES
from support.processes import one_error_line, run_tool
from support.fake_profiles import hot_op, make_profile, padding_dim
from tpu_agent.propose.knobs import aligned_to, candidates_for, discover, pad_group
from tpu_agent.plan.rewrite import rewrite_source

SCRIPT = '''\
import argparse
import torch
import torch.nn as nn
from sizes import VOCAB

HIDDEN = 1023          # a width
D = 96
EPOCHS = 3             # a loop count, not a dim
LR_STEPS = 2

class MLP(nn.Module):
    def __init__(self, d_in, d_hidden, n_out=10):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, n_out)
        self.qkv = nn.Linear(D, 3 * D)


def build(width=300):
    return nn.Sequential(nn.Embedding(VOCAB, width), MLP(784, HIDDEN))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch-size", "-b", type=int, default=127)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=0.1)
    args = p.parse_args()
    x = torch.randn(args.batch_size, 784)
    y = x.view(-1, 1)
    z = x.view(args.batch_size, 28, 28)
    for _ in range(EPOCHS * args.steps):
        pass
    loader = torch.utils.data.DataLoader(range(10), batch_size=args.batch_size)
    return "a,b".split(",", 1)
'''


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "sizes.py").write_text("VOCAB = 50257  # GPT-2\n")
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    return script


def by_name(report) -> dict[str, object]:
    return {k.name or f"literal@{k.line}:{k.column}": k for k in report.knobs}


def test_candidates_are_next_multiples_never_smaller() -> None:
    assert candidates_for(127) == [128, 256]
    assert candidates_for(1023) == [1024]
    assert candidates_for(10) == [16, 128, 256]
    assert candidates_for(128) == [256]
    assert candidates_for(256) == []
    assert candidates_for(50257) == [50264, 50304, 50432]
    assert (aligned_to(50257), aligned_to(96), aligned_to(128), aligned_to(768)) == (1, 8, 128, 256)


def test_static_scan_finds_the_dims_and_only_the_dims(project: Path) -> None:
    report = discover(project)
    knobs = by_name(report)
    assert report.files == ["train.py", "sizes.py"]
    assert set(knobs) == {"HIDDEN", "D", "VOCAB", "width", "n_out", "--batch-size", "literal@20:57", "literal@29:37"}
    # Not dims: loop counts, the float lr, --steps (only in range()), the 1 in view(-1, 1), split's maxsplit,
    # and view(b, 28, 28)'s bare literals (they must agree with the tensor's size: padding one alone breaks it).
    assert not {"EPOCHS", "LR_STEPS", "--steps", "--lr"} & set(knobs)

    hidden = knobs["HIDDEN"]
    assert (hidden.file, hidden.line, hidden.column, hidden.value, hidden.where) == ("train.py", 6, 9, 1023, "constant")
    assert hidden.candidates == [1024]
    assert any("MLP(d_hidden) -> nn.Linear(out_features)" in u for u in hidden.uses)

    vocab = knobs["VOCAB"]
    assert (vocab.file, vocab.line, vocab.column) == ("sizes.py", 1, 8)
    assert vocab.uses == ["nn.Embedding(num_embeddings) at train.py:20"]

    batch = knobs["--batch-size"]
    assert batch.where == "argparse" and batch.value == 127 and batch.batch
    assert {u.split(" at ")[0] for u in batch.uses} >= {"torch.randn size", ".view()", "DataLoader(batch_size=)"}

    assert knobs["D"].derived == [288]  # 3 * D
    assert knobs["width"].where == "parameter" and knobs["width"].value == 300
    assert knobs["n_out"].uses == ["nn.Linear(out_features) at train.py:15"]
    # A bare literal passed to the script's own class reaches nn.Linear through its parameter.
    mlp_784 = knobs["literal@20:57"]
    assert mlp_784.value == 784 and mlp_784.uses == ["MLP(d_in) -> nn.Linear(in_features) at train.py:20"]
    assert knobs["literal@29:37"].uses == ["torch.randn size at train.py:29"]


def test_every_knob_position_is_one_rewrite_accepts(project: Path) -> None:
    """knobs and rewrite agree on positions: each knob padded to its first candidate rewrites cleanly."""
    report = discover(project)
    for knob in report.knobs:
        path = project.parent / knob.file
        source = path.read_bytes()
        out = rewrite_source(source, [knob.pad_dim(knob.candidates[0])], filename=knob.file)
        assert out != source
        assert out.replace(str(knob.candidates[0]).encode(), str(knob.value).encode(), 1) == source


def test_argparse_default_overridden_on_the_command_line(project: Path) -> None:
    plain = by_name(discover(project))["--batch-size"]
    assert plain.overridden is None
    for args in (["--batch-size", "64"], ["--batch-size=64"], ["-b", "64"]):
        report = discover(project, script_args=args)
        knob = by_name(report)["--batch-size"]
        assert knob.overridden and "command line" in knob.overridden
        assert report.knobs[-1] is knob  # ranked last: padding its default changes nothing


def test_bare_literals_of_one_value_in_one_body_form_a_group(tmp_path: Path) -> None:
    script = tmp_path / "cnn.py"
    script.write_text(textwrap.dedent("""\
        import torch.nn as nn
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.conv = nn.Conv2d(3, 16, 3)
                self.bn = nn.BatchNorm2d(16)
        head = nn.Linear(16, 10)
        """))
    report = discover(script)
    sixteen = [k for k in report.knobs if k.value == 16]
    assert len(sixteen) == 3
    in_net = [k for k in sixteen if k.line in (5, 6)]
    assert in_net[0].group == in_net[1].group != next(k for k in sixteen if k.line == 7).group
    pads = pad_group(report.knobs, in_net[0], 128)
    assert sorted((p.line, p.new) for p in pads) == [(5, 128), (6, 128)]


def test_profile_ranks_by_flop_share_and_reports_padding(project: Path) -> None:
    profile = make_profile(
        hot_ops=[
            hot_op((127, 784), (784, 1023), (127, 1023), share=0.6),  # batch, 784, HIDDEN
            hot_op((127, 1023), (1023, 10), (127, 10), share=0.05),
            hot_op((127, 96), (96, 288), (127, 288), share=0.2),  # D and 3 * D
        ],
        padding_dims=[padding_dim(10, 128, 0.03), padding_dim(1023, 1024, 0.001)],
    )
    report = discover(project, profile=profile, profile_path="p.json")
    knobs = by_name(report)
    assert knobs["--batch-size"].flop_share == pytest.approx(0.85) and knobs["--batch-size"].matched_ops == 3
    assert knobs["HIDDEN"].flop_share == pytest.approx(0.65)
    assert knobs["D"].flop_share == pytest.approx(0.2)
    assert knobs["VOCAB"].flop_share == 0 and knobs["VOCAB"].matched_ops == 0
    assert (knobs["n_out"].padded_to, knobs["n_out"].padding_waste) == (128, 0.03)
    order = [k.name for k in report.knobs]
    assert order.index("--batch-size") < order.index("HIDDEN") < order.index("D") < order.index("n_out")
    assert "p.json" in report.note
    assert all(k.flop_share is None for k in discover(project).knobs)


# ------------------------------------------------------------------ the command


def test_knobs_command_on_odd_shapes_json() -> None:
    proc = run_tool("knobs", str(EXAMPLES / "odd_shapes.py"), "--static", "--json", cwd=EXAMPLES)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    found = {k["name"]: (k["value"], k["candidates"]) for k in data["knobs"]}
    assert found == {
        "BATCH": (50, [56, 128, 256]), "CHANNELS": (3, [8, 128, 256]), "IMAGE_SIZE": (16, [128, 256]),
        "WIDTH": (63, [64, 128, 256]), "WIDE": (127, [128, 256]), "HIDDEN": (255, [256]),
        "NUM_CLASSES": (10, [16, 128, 256]), "NUM_BATCHES": (4, [8, 128, 256]),
    }
    assert data["profile"] is None


def test_knobs_command_uses_the_newest_profile_of_the_script(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    (tmp_path / "sizes.py").write_text("VOCAB = 50257\n")
    runs = tmp_path / ".tpu-agent" / "runs"
    for name, share in (("20260101-000000-train", 0.1), ("20260102-000000-train", 0.9)):
        (runs / name).mkdir(parents=True)
        prof = make_profile(script=str(script), hot_ops=[hot_op((127, 784), (784, 1023), (127, 1023), share)])
        (runs / name / "profile.json").write_text(prof.model_dump_json())
    other = runs / "20260103-000000-other"
    other.mkdir()
    (other / "profile.json").write_text(make_profile(script=str(tmp_path / "other.py")).model_dump_json())
    proc = run_tool("knobs", "train.py", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "20260102-000000-train" in proc.stdout and "FLOP share" in proc.stdout
    assert "90.0%" in proc.stdout
    static = run_tool("knobs", "train.py", "--static", cwd=tmp_path)
    assert "static only" in static.stdout and "FLOP share" not in static.stdout


def test_knobs_command_bad_inputs(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(SCRIPT)
    (tmp_path / "bad.json").write_text('{"status": "stopped"}')
    proc = run_tool("knobs", "train.py", "--profile", "bad.json", cwd=tmp_path)
    assert proc.returncode == 2
    assert "not a tpu-agent profile: bad.json" in one_error_line(proc)
    missing = run_tool("knobs", "nope.py", cwd=tmp_path)
    assert missing.returncode == 2 and one_error_line(missing) == "error: script not found: nope.py"


def test_a_size_inside_a_dataset_class_shapes_the_data_not_the_model(tmp_path: Path) -> None:
    # The Trainer example's RandomTokens(64): its n reaches torch.randint's size inside a Dataset, so the
    # tuner must call it a change to the data (never made), not a model change `--allow model` would search.
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""\
        import torch
        import torch.nn as nn
        from torch.utils.data import Dataset

        class Tokens(Dataset):
            def __init__(self, n):
                self.ids = torch.randint(0, 512, (n, 32))

        class Net(nn.Module):
            def __init__(self, width):
                super().__init__()
                self.table = torch.zeros(width, 8)

        data = Tokens(64)
        net = Net(48)
        """))
    knobs = {k.value: k for k in discover(script).knobs}
    assert knobs[64].effect == "data", knobs[64].effect_why
    assert "Tokens" in knobs[64].effect_why or "randint" in knobs[64].effect_why
    assert knobs[48].effect == "model", knobs[48].effect_why
