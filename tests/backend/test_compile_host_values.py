"""A compiled step that moves small CPU values in (PyTorch's C++ code wraps Python scalars so)
replays as one program while those values stay the same, and stays right when they change."""

from __future__ import annotations

import warnings

import torch


def _run(values):
    w = torch.ones(4, device="tpu")
    current = {}

    def step(x):  # the value comes from outside the arguments, as a script's global would
        return (x * torch.tensor(current["v"]).to("tpu") + w).sum()

    compiled = torch.compile(step)
    x = torch.arange(4.0, device="tpu")
    out = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for v in values:
            current["v"] = v
            out.append(compiled(x).item())
    return out, compiled._target, [str(w.message) for w in caught]


def test_same_host_value_every_call_replays_one_program():
    out, target, said = _run([2.0] * 6)
    assert out == [16.0] * 6
    assert target.replays >= 3 and target.reason_not_replayed is None, (target.replays, said)


def test_changing_host_values_are_never_baked_into_a_replay():
    values = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    out, target, said = _run(values)
    assert out == [6.0 * v + 4.0 for v in values]
    assert target.replays == 0
    assert any("cannot be one program" in s for s in said), said
