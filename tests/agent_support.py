"""Shared inputs for the agent tests: recorded profiles and knobs read from the examples.

The profiles in tests/data were written by `tpu-agent profile examples/NAME.py
--steps 3` (fused mode, TPU v5e padding model), with machine paths removed.
tests/data/scripts holds each script as it was when its profile was
recorded, so that a profile and the literals it is matched with stay a pair
when an example changes (odd_shapes.py there is the earlier MLP version).
`knobs_of` stands in for the knob finder (tpu_agent/knobs.py, built
elsewhere): every module-level `NAME = <int literal>` of the script.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

from tpu_agent.profilers.schema import Profile

REPO = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"
EXAMPLES = REPO / "examples"
RECORDED = DATA / "scripts"


def profile_data(name: str) -> dict:
    return json.loads((DATA / f"profile_{name}.json").read_text())


def profile(name: str) -> Profile:
    return Profile.model_validate(profile_data(name))


def knobs_of(path: Path) -> list[dict]:
    tree = ast.parse(Path(path).read_text())
    out = []
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Constant) and type(node.value.value) is int):
            out.append({"file": Path(path).name, "line": node.value.lineno, "column": node.value.col_offset,
                        "value": node.value.value, "name": node.targets[0].id})
    return out


def example_knobs(name: str) -> list[dict]:
    return knobs_of(RECORDED / f"{name}.py")
