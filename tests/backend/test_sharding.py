"""Sharded runs over simulated devices match the unsharded losses."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from support.paths import EXAMPLES

SCRIPT = textwrap.dedent("""
    import sys, json, torch, torch.nn.functional as F
    sys.path.insert(0, {examples!r})
    devices = int(sys.argv[1])
    RULES = {{
        "mlp": [("fc1.weight", ("model", None)), ("fc1.bias", ("model",)), ("fc2.weight", (None, "model"))],
        "transformer": [("*.mlp.0.weight", ("model", None)), ("*.mlp.0.bias", ("model",)),
                        ("*.mlp.2.weight", (None, "model")), ("tok_emb.weight", (None, "model"))],
    }}

    def data():
        g = torch.Generator().manual_seed(0)
        if name == "mlp":
            x, y = ex.make_data(g)
            return [(x[i].to("tpu"), y[i].to("tpu")) for i in range(3)]
        tokens = torch.randint(0, ex.VOCAB, (3, 4, ex.SEQ_LEN + 1), generator=g).to("tpu")
        return [(t[:, :-1], t[:, 1:]) for t in tokens]

    def run(layout, mode):
        torch.manual_seed(0)
        model = (ex.MLP() if name == "mlp" else ex.TinyGPT()).to("tpu")
        opt = torch.optim.SGD(model.parameters(), lr=0.1) if name == "mlp" else torch.optim.AdamW(model.parameters(), lr=1e-3)
        per_device = None
        if layout != "single":
            axes = {{"data": devices}} if layout == "data" else {{"data": 2, "model": devices // 2}}
            torch.tpu.sharding.set_mesh(axes)
            torch.tpu.sharding.shard_module(model, RULES[name] if layout == "rules" else [])
            torch.tpu.sharding.shard_batches(model, "data")
            per_device = max(s.data.nbytes for s in model.parameters().__next__().jax().addressable_shards)

        def step(x, y):
            opt.zero_grad()
            out = model(x)
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
            loss.backward()
            opt.step()
            return loss

        if mode == "compiled":
            step = torch.compile(step)
        losses = []
        for x, y in data():
            with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE if mode == "fused" else torch.tpu.EagerMode.DEFER_NEVER):
                losses.append(step(x, y).item())
        torch.tpu.sharding.set_mesh(None)
        return losses, per_device

    result = {{}}
    for case in sys.argv[2:]:  # "example:mode,mode": the examples share this process and its compiled programs
        name, modes = case.split(":")
        ex = __import__(name)
        for i, mode in enumerate(modes.split(",")):  # the unsharded reference: the example's first mode
            for layout in ("single", "data", "rules")[i > 0:]:
                result[f"{{name}}/{{mode}}/{{layout}}"] = run(layout, mode)
    print("RESULT", json.dumps(result))
""").format(examples=str(EXAMPLES))


def run_sharded(devices: int, cases: dict[str, str]) -> dict:
    import json

    args = [f"{name}:{modes}" for name, modes in cases.items()]
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(devices), *args], capture_output=True, text=True,
                         timeout=900, env={**os.environ, "TPU_AGENT_DEVICES": str(devices)})
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(l for l in out.stdout.splitlines() if l.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


# Per device count, one process (the device count is fixed when XLA starts): each example in its modes. The
# default pass runs 4 devices (a 2 x 2 mesh for the rules: every mode, each example); the 2-device case (a data
# axis of 2 and a model axis of 1) runs in the release matrix (`-m matrix`, docs/ci.md).
CASES = {
    2: {"mlp": "eager,fused,compiled", "transformer": "eager"},
    4: {"mlp": "eager", "transformer": "fused,compiled"},
}
MATRIX_ONLY = (2,)


@pytest.mark.parametrize("devices", [pytest.param(n, marks=pytest.mark.matrix) if n in MATRIX_ONLY else n
                                     for n in CASES], ids=lambda n: f"{n}-devices")
def test_sharded_losses_match_unsharded(devices):
    """Each example's losses in each of its modes, sharded over the data axis and by the rules (data x model), as
    the example's unsharded run gives them in its first mode: the unsharded run in the other modes gives the same
    losses (tests/backend/test_modes.py holds every mode to the CPU's), so it is not run again."""
    result = run_sharded(devices, CASES[devices])
    for name, modes in CASES[devices].items():
        reference, _ = result[f"{name}/{modes.split(',')[0]}/single"]
        for mode in modes.split(","):
            for layout in ("data", "rules"):
                losses, _ = result[f"{name}/{mode}/{layout}"]
                assert losses == pytest.approx(reference, rel=1e-5), f"{name} {mode}/{layout}"
    if devices == 4:
        # fc1.weight split over the 2-way model axis: half its bytes on each device.
        mode = CASES[devices]["mlp"].split(",")[0]
        _, replicated = result[f"mlp/{mode}/data"]
        _, split = result[f"mlp/{mode}/rules"]
        assert split * 2 == replicated
