"""Knobs followed through configs (dicts, **kwargs, dataclasses, argparse and configurator globals), the defaults a
script overrides left out, and the modules a profile recorded tying each knob to what it sizes (issue #24)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from support.paths import DATA
from support.processes import run_tool
from tpu_agent.propose.knobs import discover
from tpu_agent.propose.scope import knobs_in_scope

NANOGPT = DATA / "scripts" / "nanogpt_dict.py"


def write(tmp_path: Path, source: str, name: str = "train.py") -> Path:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source))
    return path


def at(report, line: int):
    """The knob on a line (the test scripts put one per line)."""
    found = [k for k in report.knobs if k.line == line]
    assert len(found) == 1, [k.label for k in report.knobs]
    return found[0]


def test_a_dict_and_its_item_assignment_reach_a_dataclass_and_override_its_defaults(tmp_path: Path) -> None:
    script = write(tmp_path, """\
        from dataclasses import dataclass
        import torch.nn as nn

        @dataclass
        class Config:
            vocab: int = 1000
            width: int = 96
            depth: int = 2

        class Net(nn.Module):
            def __init__(self, cfg):
                super().__init__()
                self.emb = nn.Embedding(cfg.vocab, cfg.width)
                self.out = nn.Linear(cfg.width, cfg.vocab)

        VOCAB = 50257
        args = {"width": 100}
        args["vocab"] = VOCAB
        net = Net(Config(**args))
        small = Config(vocab=VOCAB)
        """)
    report = discover(script)
    vocab = at(report, 16)
    assert (vocab.name, vocab.value, vocab.where, vocab.overridden) == ("VOCAB", 50257, "constant", None)
    assert "args['vocab'] -> Config(vocab) -> nn.Embedding(num_embeddings) at train.py:19" in vocab.uses
    assert 50304 in vocab.candidates and vocab.effect == "model"
    width = at(report, 17)  # the dict literal's value, named by its key
    assert (width.name, width.value, width.where) == ("width", 100, "literal")
    assert width.uses[0].startswith("args['width'] -> Config(width) -> ")
    # Both calls set vocab: its default is never used. Config(vocab=VOCAB) leaves width at its default.
    default_vocab, default_width = at(report, 6), at(report, 7)
    assert default_vocab.where == "parameter" and "Config(**args) (2 calls) at train.py:19" in default_vocab.overridden
    assert default_width.overridden is None
    assert not [k for k in report.knobs if k.line == 8]  # depth sizes nothing
    kept, out = knobs_in_scope(report.knobs, ["model"])
    assert default_vocab not in kept and any("not searched, overridden: Config(**args)" in line for _, line in out)
    assert report.knobs[-1] is default_vocab  # ranked last


def test_kwargs_are_forwarded_into_modules_and_classes(tmp_path: Path) -> None:
    script = write(tmp_path, """\
        import torch.nn as nn

        def make_head(**kwargs):
            return nn.Linear(**kwargs)

        class Block(nn.Module):
            def __init__(self, d_model=512, n_classes=10):
                super().__init__()
                self.fc = nn.Linear(d_model, n_classes)

        def build(**kw):
            return Block(**kw)

        head = make_head(in_features=300, out_features=7)
        block = build(d_model=1000)
        """)
    report = discover(script)
    head = {k.value: k.uses for k in report.knobs if k.line == 14}
    assert head == {300: ["make_head(**kwargs) -> nn.Linear(in_features) at train.py:14"],
                    7: ["make_head(**kwargs) -> nn.Linear(out_features) at train.py:14"]}
    width = at(report, 15)
    assert width.value == 1000 and width.uses[0].startswith("build(**kw) -> Block(d_model) -> nn.Linear(in_features)")
    d_model, n_classes = (next(k for k in report.knobs if k.name == n and k.where == "parameter")
                          for n in ("d_model", "n_classes"))
    assert "build(...) at train.py:15" not in (d_model.overridden or "")
    assert d_model.overridden and "Block(...) at train.py:15 sets d_model" in d_model.overridden
    assert n_classes.overridden is None  # no call sets it


def test_argparse_options_reach_a_class_through_vars_and_a_dict(tmp_path: Path) -> None:
    script = write(tmp_path, """\
        import argparse
        import torch.nn as nn

        class Net(nn.Module):
            def __init__(self, hidden, classes=10):
                super().__init__()
                self.fc = nn.Linear(hidden, classes)

        p = argparse.ArgumentParser()
        p.add_argument("--hidden", type=int, default=1000)
        p.add_argument("--classes", type=int, default=12)
        args = p.parse_args()
        net = Net(**vars(args))
        cfg = dict(hidden=args.hidden)
        other = Net(**cfg)
        """)
    report = discover(script)
    hidden, classes = at(report, 10), at(report, 11)
    assert hidden.where == "argparse"
    assert "vars(args) -> Net(hidden) -> nn.Linear(in_features) at train.py:13" in hidden.uses
    assert "vars(args) -> Net(classes) -> nn.Linear(out_features) at train.py:13" in classes.uses
    default = next(k for k in report.knobs if k.where == "parameter" and k.name == "classes")
    assert default.overridden is None  # Net(**cfg) does not set it
    assert "command line" in at(discover(script, script_args=["--hidden=64"]), 10).overridden


def test_configurator_globals_overridden_later_on_the_command_line_or_by_a_config_file(tmp_path: Path) -> None:
    script = write(tmp_path, """\
        import torch
        import torch.nn as nn

        n_embd = 768
        batch_size = 12
        vocab = 50257
        n_embd = 384
        exec(open('configurator.py').read())
        model = nn.Embedding(vocab, n_embd)
        x = torch.randint(0, vocab, (batch_size, 8))
        """)
    write(tmp_path, "n_embd = 100\nvocab = 50304\n", "config/small.py")
    plain = discover(script)
    assert at(plain, 4).overridden == "overridden: n_embd is set again at train.py:7"
    assert at(plain, 7).overridden is None and at(plain, 5).overridden is None
    report = discover(script, script_args=["config/small.py", "--batch_size=32"])
    assert "config/small.py" in report.files
    assert "--batch_size=32 on the command line" in at(report, 5).overridden
    assert at(report, 6).overridden == ("overridden: config/small.py:2 sets vocab (the configurator at train.py:8)")
    from_config = [k for k in report.knobs if k.file == "config/small.py"]
    assert {(k.name, k.value) for k in from_config} == {("n_embd", 100), ("vocab", 50304)}
    assert all(k.overridden is None for k in from_config)
    # `w = w * 2` builds on the first value; a configurator that runs before the assignment cannot override it.
    builds = write(tmp_path, """\
        import torch.nn as nn
        w = 100
        w = w * 2
        exec(open('configurator.py').read())
        v = 300
        m = nn.Linear(w, v)
        """, "builds.py")
    assert at(discover(builds), 2).overridden is None
    args = ["--w=5", "--v=7"]
    assert "--w=5 on the command line" in at(discover(builds, script_args=args), 2).overridden
    assert at(discover(builds, script_args=args), 5).overridden is None


def test_odd_configs_never_crash_the_finder(tmp_path: Path) -> None:
    script = write(tmp_path, """\
        import json
        from dataclasses import dataclass, field
        from typing import ClassVar
        import torch.nn as nn

        @dataclass(frozen=True)
        class C:
            registry: ClassVar[int] = 3
            width: int = 96
            tags: list = field(default_factory=list)

        def f(*args, **kwargs):
            return nn.Linear(*args, **kwargs)

        key = "width"
        d = {}
        d[key] = 5
        d.update({"width": 64}, extra=3)
        e = {**d, "vocab": 77, 1: 2}
        c = C(**json.load(open("c.json")))
        g = C(*[1, 2])
        exec("x = 1")
        lin = f(10, 20, **e)
        lin2 = nn.Linear(**{"in_features": 33, "out_features": 44})
        lin3 = nn.Linear(c.width, 10)
        """)
    report = discover(script)
    assert at(report, 9).overridden is None  # C(**json.load(...)) may or may not set width
    assert {k.value for k in report.knobs if k.line == 24} == {33, 44}


# ------------------------------------------------------------------ the nanoGPT-style script


def test_nanogpt_static_finds_the_vocabulary_through_the_dict_and_not_the_defaults() -> None:
    report = discover(NANOGPT)
    vocab = next(k for k in report.knobs if k.name == "meta_vocab_size")
    assert (vocab.value, vocab.where, vocab.effect, vocab.overridden) == (50257, "constant", "model", None)
    assert vocab.candidates == [50264, 50304, 50432]
    assert vocab.uses[0].startswith("model_args['vocab_size'] -> GPTConfig(vocab_size) -> nn.Embedding(num_embeddings)")
    defaults = {k.name: k for k in report.knobs if k.where == "parameter"}
    assert {n: defaults[n].value for n in ("vocab_size", "n_head", "n_embd", "block_size")} == {
        "vocab_size": 50304, "n_head": 12, "n_embd": 768, "block_size": 1024}
    assert all("GPTConfig(**model_args)" in k.overridden for k in defaults.values())
    kept, _ = knobs_in_scope(report.knobs, ["model", "training"])
    assert {(k.name, k.value) for k in kept} >= {("meta_vocab_size", 50257), ("n_head", 4), ("n_embd", 64)}
    assert not [k for k in kept if k.where == "parameter"]  # the dataclass defaults: never proposed


def test_nanogpt_profile_records_the_modules_built_and_ties_the_vocabulary_to_them(tmp_path: Path) -> None:
    """The real profiler on the script (about 15 s): Embedding(50257, 64) as built, and the knobs tied to it."""
    proc = run_tool("profile", str(NANOGPT), "--steps", "1", "--warmup", "1", "--json", "-o", str(tmp_path / "runs"),
                    cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from tpu_agent.profilers.schema import Profile

    prof = Profile.model_validate(json.loads(proc.stdout))
    assert prof.modules is not None and prof.modules.models == ["GPT"]
    built = {(m.kind, tuple(m.sizes.values())): m for m in prof.modules.sizes}
    assert built[("Embedding", (50257, 64))].paths == ["transformer.wte"]
    assert built[("Linear", (64, 50257))].paths == ["lm_head"]
    assert built[("Linear", (64, 192))].count == 2  # one c_attn per block, grouped

    report = discover(NANOGPT, profile=prof)
    vocab = next(k for k in report.knobs if k.name == "meta_vocab_size")
    assert 50304 in vocab.candidates and vocab.unused is None
    assert [m.split(":")[1].strip() for m in vocab.modules] == ["transformer.wte", "lm_head"]
    assert any(m.startswith("CausalSelfAttention(n_head=4") for m in next(
        k for k in report.knobs if k.name == "n_head" and k.value == 4).modules)
    batch = next(k for k in report.knobs if k.batch)
    assert batch.modules == []  # a batch of 4 sizes no module, whatever else is 4
    # The `else 50304` of model_args['vocab_size'] sizes nothing the run built: never searched.
    fallback = next(k for k in report.knobs if k.where == "literal" and k.value == 50304)
    assert fallback.unused and "no module of GPT was built with 50304" in fallback.unused
    kept, out = knobs_in_scope(report.knobs, ["model", "training"])
    assert vocab in kept and fallback not in kept
    assert any(line.startswith(f"{fallback.label}: not searched, sizes nothing") for _, line in out)

    (tmp_path / "profile.json").write_text(prof.model_dump_json())
    shown = run_tool("knobs", str(NANOGPT), "--profile", "profile.json", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "sizes Embedding transformer.wte" in shown.stdout and "not searched: sizes" in shown.stdout


def test_module_watch_groups_sizes_and_stops_at_a_step() -> None:
    import torch.nn as nn

    from tpu_agent.profilers.modules import ModuleWatch

    model = nn.Sequential(nn.Embedding(50257, 64), nn.LayerNorm(64), nn.Linear(64, 64), nn.Linear(64, 64), nn.GELU())
    watch = ModuleWatch()
    watch.record(model)
    report = watch.report()
    assert report.models == ["Sequential"]
    assert [(m.kind, m.sizes, m.count, m.paths) for m in report.sizes] == [
        ("Embedding", {"num_embeddings": 50257, "embedding_dim": 64}, 1, ["0"]),
        ("LayerNorm", {"normalized_shape": [64]}, 1, ["1"]),
        ("Linear", {"in_features": 64, "out_features": 64}, 2, ["2", "3"]),
    ]
    assert report.sizes[2].describe() == "Linear(in_features=64, out_features=64) x2: 2, 3"
    assert ModuleWatch().report() is None  # no model on tpu: nothing recorded
    watch.install()
    assert watch._hook is not None
    watch._on_step("optimizer")
    assert watch._hook is None and watch._remove_listener is None  # the measured steps pay nothing
