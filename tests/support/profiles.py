"""Recorded profiles and knobs read from the examples, for the proposer and playbook tests.

The profiles in tests/data were written by `tpu-agent profile examples/NAME.py
--steps 3` (fused mode, TPU v5e padding model), with machine paths removed.
Each is read with the script it was taken of (`SCRIPTS`), so that a profile
and the literals it is matched with stay a pair: transformer's is
examples/transformer.py; odd_mlp's was taken of the MLP that
examples/odd_shapes.py was at commit 43717f2 (the profile's file names renamed
to odd_mlp.py), which is examples/odd_mlp.py now: its sizes stand on the same
lines and columns, and its model, data and step are the same (the loop and
the command line moved to examples/training.py, so the source lines the
profile gives for the loss and backward ops are the earlier file's).
`knobs_of` stands in for the knob finder (tpu_agent/propose/knobs.py):
every module-level `NAME = <int literal>` of the script, as a `Knob` whose
batch flag comes from its name.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

from tpu_agent.profilers.schema import Profile

from tpu_agent.propose.knobs import Knob, aligned_to, candidates_for
from tpu_agent.propose.conditions import name_words

from support.paths import DATA, EXAMPLES

SCRIPTS = {"odd_mlp": EXAMPLES / "odd_mlp.py", "transformer": EXAMPLES / "transformer.py"}


def profile_data(name: str) -> dict:
    return json.loads((DATA / f"profile_{name}.json").read_text())


def profile(name: str) -> Profile:
    return Profile.model_validate(profile_data(name))


def knob(file: str, line: int, column: int, value: int, name: str | None, **fields) -> Knob:
    """A Knob as the finder would report it; `batch` defaults to what the name says (BATCH, batch_size, bs)."""
    batch = fields.pop("batch", any(w.startswith("batch") or w in ("bs", "bsz") for w in name_words(name or "")))
    return Knob(file=file, line=line, column=column, value=value, name=name, where="constant", uses=[],
                candidates=fields.pop("candidates", []), aligned_to=aligned_to(value), batch=batch, **fields)


def knobs_of(path: Path) -> list[Knob]:
    tree = ast.parse(Path(path).read_text())
    out = []
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Constant) and type(node.value.value) is int):
            out.append(knob(Path(path).name, node.value.lineno, node.value.col_offset, node.value.value,
                            node.targets[0].id))
    return out


def recorded_script(name: str) -> Path:
    """The script the recorded profile `name` was taken of."""
    return SCRIPTS[name]


def example_knobs(name: str) -> list[Knob]:
    """The knobs of the script the recorded profile `name` was taken of."""
    return knobs_of(recorded_script(name))
