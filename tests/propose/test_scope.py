"""The classes of change: a literal that shapes the data is never proposed; a model or training change is searched
only with `--allow`; every action of report.json says its class."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from support.fake_profiles import hot_op, make_profile, padding_dim
from support.fake_tune import tune
from tpu_agent.plan.actions import PadDim
from tpu_agent.propose.knobs import discover
from tpu_agent.propose.offline import OfflineProposer
from tpu_agent.propose.scope import knobs_in_scope

# The hidden MLP of issue #13: batch 100, 777 -> 1111 -> 1111 -> 10.
MLP = textwrap.dedent("""
    import torch
    import torch.nn.functional as F

    BATCH_SIZE = 100
    IN_FEATURES = 777
    HIDDEN = 1111

    class MLP(torch.nn.Module):
        def __init__(self, d_in, d_hidden):
            super().__init__()
            self.fc1 = torch.nn.Linear(d_in, d_hidden)
            self.fc2 = torch.nn.Linear(d_hidden, d_hidden)
            self.out = torch.nn.Linear(d_hidden, 10)

        def forward(self, x):
            return self.out(F.relu(self.fc2(F.relu(self.fc1(x)))))

    model = MLP(IN_FEATURES, HIDDEN).to("tpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(BATCH_SIZE, IN_FEATURES).to("tpu")
    y = torch.randint(0, 10, (BATCH_SIZE,)).to("tpu")
    for step in range(10):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
""")


@pytest.fixture()
def project(tmp_path: Path) -> Path:
    (tmp_path / "train.py").write_text(MLP)
    return tmp_path


def profile_of_the_mlp(project: Path):
    ops = [hot_op((100, 777), (777, 1111), (100, 1111), 0.4), hot_op((100, 1111), (1111, 1111), (100, 1111), 0.5)]
    dims = [padding_dim(777, 896, 0.3), padding_dim(1111, 1152, 0.5), padding_dim(100, 104, 0.1)]
    return make_profile(script=str(project / "train.py"), hot_ops=ops, padding_dims=dims, waste=0.2)


def test_the_knob_finder_tells_data_from_model_from_training(project: Path):
    knobs = {k.name: k for k in discover(project / "train.py").knobs}
    assert knobs["IN_FEATURES"].effect == "data"
    assert knobs["IN_FEATURES"].effect_why == "it shapes the data: torch.randn size at train.py:21"
    assert knobs["HIDDEN"].effect == "model" and "nn.Linear" in knobs["HIDDEN"].effect_why
    assert knobs["BATCH_SIZE"].effect == "training" and "per sample" in knobs["BATCH_SIZE"].effect_why

    kept, left = knobs_in_scope(list(knobs.values()), allow=["model", "training"])
    assert "IN_FEATURES" not in {k.name for k in kept}  # never, whatever --allow says
    (line,) = [text for k, text in left if k.name == "IN_FEATURES"]
    assert line == ("IN_FEATURES = 777 (train.py:6:14): not proposed, it shapes the data: torch.randn size at "
                    "train.py:21 (the tuner never changes the data)")


def pad_dims_searched(result) -> set[str]:
    return {a.name for t in result.trials for a in t.plan.actions if isinstance(a, PadDim)}


def test_a_data_literal_is_never_proposed_and_a_model_change_needs_allow_model(project: Path, monkeypatch):
    profile = profile_of_the_mlp(project)
    default, _, said = tune(project, monkeypatch, OfflineProposer(), trials=6, profile=profile)
    assert pad_dims_searched(default) == set()  # exact and numerics only
    assert any("HIDDEN = 1111" in line and "`--allow model` searches it" in line for line in default.left_out)
    assert "IN_FEATURES = 777 (train.py:6:14): not proposed" in said  # said on the console, one line

    (project / "s.db").unlink()
    opened, _, _ = tune(project, monkeypatch, OfflineProposer(), trials=12, profile=profile, allow=["model"])
    searched = pad_dims_searched(opened)
    assert "HIDDEN" in searched and "IN_FEATURES" not in searched and "BATCH_SIZE" not in searched
    report = json.loads((Path(opened.run_dir) / "report.json").read_text())
    for trial in report["trials"]:
        for action in trial["plan"]["actions"]:
            assert action["effect"] in ("exact", "numerics", "model"), action  # every action says its class
