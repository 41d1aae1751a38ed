"""An example script run at world size 2 twice, as the distributed tests compare them: on tpu under
`tpu-agent run --nproc 2`, and as the reference, under plain torchrun on CPU tensors with gloo and the tool
off. Each run's script writes DIR/rankN.json (its per-step losses and final parameters) with `--out DIR`."""

from __future__ import annotations

import json
import math
from pathlib import Path

from support.paths import EXAMPLES
from support.processes import clean_env, run_python, run_tool

GLOO_TEARDOWN_ABORT = "terminate called without an active exception"


def _twice_if_gloo_aborts(run):
    """PyTorch's gloo sometimes aborts a rank at teardown under load: not what is tested, so once more."""
    proc = run()
    if proc.returncode != 0 and GLOO_TEARDOWN_ABORT in proc.stderr:
        proc = run()
    return proc


def run_ranks(example: str, args: list[str], out: Path, *, on: str, env: dict[str, str] | None = None,
              timeout: float = 300) -> list[dict]:
    """`examples/<example>` at world size 2 on "tpu" or "cpu" (gloo, the tool off); each rank's rankN.json."""
    out.mkdir(parents=True, exist_ok=True)
    args = [*args, "--out", str(out)]
    if on == "tpu":
        proc = _twice_if_gloo_aborts(lambda: run_tool(
            "run", "--nproc", "2", str(EXAMPLES / example), "--", *args, cwd=out, env=clean_env(**(env or {})),
            timeout=timeout))
    else:
        proc = _twice_if_gloo_aborts(lambda: run_python(
            "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(EXAMPLES / example), *args,
            "--device", "cpu", cwd=out, env=clean_env(TPU_AGENT_DEVICE="off", **(env or {})), timeout=timeout))
    assert proc.returncode == 0, f"{example} on {on}:\n{proc.stderr[-4000:]}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def worst_loss_error(run: dict, reference: dict) -> float:
    """The largest relative difference of a step's loss (every step present in both, in order)."""
    assert len(run["losses"]) == len(reference["losses"]) > 0
    return max(abs(a - b) / abs(b) for a, b in zip(run["losses"], reference["losses"]))


def parameter_errors(run: dict, reference: dict) -> dict[str, float]:
    """Each parameter's distance from the reference's, relative to the reference's norm."""
    assert run["params"].keys() == reference["params"].keys()
    errors = {}
    for name, values in run["params"].items():
        ref = reference["params"][name]
        errors[name] = math.dist(values, ref) / math.hypot(*ref)
    return errors


def model_error(run: dict, reference: dict) -> float:
    """The distance between all parameters together and the reference's, relative to the reference's norm."""
    names = list(reference["params"])
    ref = [v for n in names for v in reference["params"][n]]
    return math.dist([v for n in names for v in run["params"][n]], ref) / math.hypot(*ref)
