"""An example script run twice, as the distributed tests compare them: on tpu under `tpu-agent run --nproc N`,
and as the reference, under plain torchrun on CPU tensors with gloo and the tool off. Each run's script writes
DIR/rankN.json (its per-step losses and final parameters) with `--out DIR`.

By hand, at any world size (the figures in docs/distributed.md; XLA's default flags, not the tests' quick ones):

    cd tests && ../.venv/bin/python -m support.rank_runs fsdp_tp.py 4 --dp 2
    cd tests && TORCH_TPU_DEFER_AND_FUSE=1 ../.venv/bin/python -m support.rank_runs fsdp2.py 2 --bf16
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from datetime import datetime, timezone
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
              nproc: int = 2, timeout: float = 300) -> list[dict]:
    """`examples/<example>` at world size `nproc` on "tpu" or "cpu" (gloo, the tool off); each rank's
    rankN.json."""
    out.mkdir(parents=True, exist_ok=True)
    args = [*args, "--out", str(out)]
    if on == "tpu":
        proc = _twice_if_gloo_aborts(lambda: run_tool(
            "run", "--nproc", str(nproc), str(EXAMPLES / example), "--", *args, cwd=out,
            env=clean_env(**(env or {})), timeout=timeout))
    else:
        proc = _twice_if_gloo_aborts(lambda: run_python(
            "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), str(EXAMPLES / example),
            *args, "--device", "cpu", cwd=out, env=clean_env(TPU_AGENT_DEVICE="off", **(env or {})),
            timeout=timeout))
    assert proc.returncode == 0, f"{example} on {on}:\n{proc.stderr[-4000:]}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


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


def main(argv: list[str]) -> int:
    """EXAMPLE NPROC [ARGS...]: run it on tpu (this environment's modes) and on gloo; print each rank's errors."""
    if len(argv) < 2 or not argv[1].isdigit() or not (EXAMPLES / argv[0]).is_file():
        print("error: usage: python -m support.rank_runs EXAMPLE.py NPROC [ARGS...] (EXAMPLE in examples/)",
              file=sys.stderr)
        return 2
    example, nproc, args = argv[0], int(argv[1]), argv[2:]
    load = os.getloadavg()[0]
    modes = {k: v for k, v in os.environ.items() if k in ("TORCH_TPU_DEFER_AND_FUSE", "TPU_AGENT_COMPILE_STEPS")}
    with tempfile.TemporaryDirectory() as tmp:
        tpu = run_ranks(example, args, Path(tmp) / "tpu", on="tpu", env=modes, nproc=nproc)
        gloo = run_ranks(example, args, Path(tmp) / "gloo", on="cpu", nproc=nproc)
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"{example} {' '.join(args)} at {nproc} ranks, tpu {modes or 'eager'} vs CPU gloo "
          f"({when}, load {load:.1f} at the start)")
    for rank, (mine, ref) in enumerate(zip(tpu, gloo)):
        errors = parameter_errors(mine, ref)
        worst = max(errors, key=errors.get)
        print(f"rank {rank}: losses {worst_loss_error(mine, ref):.2g} relative, all parameters "
              f"{model_error(mine, ref):.2g} of their norm, worst parameter {errors[worst]:.2g} ({worst})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
