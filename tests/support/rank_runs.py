"""An example script run twice, as the distributed tests compare them: on tpu under `tpu-agent run --nproc N`,
and as the reference, under plain torchrun on CPU tensors with gloo and the tool off. Each run's script writes
DIR/rankN.json (its per-step losses and final parameters) with `--out DIR`.

By hand, at any world size (the figures in docs/distributed.md; XLA's default flags, not the tests' quick ones):

    cd tests && ../.venv/bin/python -m support.rank_runs fsdp_tp.py 4 --dp 2
    cd tests && TORCH_TPU_DEFER_AND_FUSE=1 ../.venv/bin/python -m support.rank_runs fsdp2.py 2 --bf16
    cd tests && ../.venv/bin/python -m support.rank_runs --matrix       # every case x mode x world size

`CASES` are the scripts issue #26 point 3 asks for with their tolerances; `check` is what the tests and
`--matrix` (the full product, too slow for the suite on a 2-core host) both hold a run to.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from support import float32_noise
from support.paths import EXAMPLES
from support.processes import clean_env, run_python, run_tool

GLOO_TEARDOWN_ABORT = "terminate called without an active exception"


def once_more_if_gloo_aborts(run):
    """For jobs whose collectives are PyTorch's gloo alone (the tool off, or a CPU-only script, which the tool
    leaves to gloo): once more if a rank aborted at exit. That is PyTorch's teardown race, not what is tested:
    gloo's worker thread drops a finished work (a barrier's) whose thread-local state holds a Python object,
    and if the interpreter is already finalizing, taking the GIL ends the thread inside a destructor
    (core dump: ProcessGroupGloo::runLoop -> ~AsyncBarrierWork -> ~ThreadLocalState -> SafePyObject decref ->
    pthread_exit -> std::terminate); 3 of 56 two-rank CPU DDP jobs under a load of 3-4. Jobs on tpu are never
    retried: their barrier runs on the device and the collective watch stops before exit (test_watch_exit.py)."""
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
        proc = run_tool("run", "--nproc", str(nproc), str(EXAMPLES / example), "--", *args, cwd=out,
                        env=clean_env(**(env or {})), timeout=timeout)
    else:
        proc = once_more_if_gloo_aborts(lambda: run_python(
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


# A resumed job's first step runs as written, where the uninterrupted job replays its captured step (compiled
# steps: forward, backward and update as one program): XLA fuses the two differently, a last-bit difference.
# In eager mode both jobs run the same op programs: a resume gives the uninterrupted run's numbers to the last bit.
RESUME_TOLERANCE = 1e-6
EXACT_RESUME = ("eager",)
MODES = {"eager": {}, "fused": {"TORCH_TPU_DEFER_AND_FUSE": "1"}, "compiled": {"TPU_AGENT_COMPILE_STEPS": "1"}}


@dataclass(frozen=True)
class Case:
    """A script with its arguments, and how close to gloo it must come: each step's loss and all parameters
    together within `tol` relative; each parameter within `each` of its own norm."""
    example: str
    args: tuple[str, ...]
    tol: float
    each: float
    checkpoint: bool = False  # save after SAVE_AT steps, then a fresh job resumes from there
    # fsdp2.py in float32: each parameter within `each` or float32's own error there (support.float32_noise.bounds)
    float32_noise: bool = False

    def arguments(self, nproc: int) -> list[str]:
        return [a.replace("{dp}", str(nproc // 2)) for a in self.args]


STEPS, SAVE_AT = 6, 3
CASES = {
    "ddp": Case("ddp.py", ("--steps", "4"), 1e-5, 1e-5),
    "fsdp2": Case("fsdp2.py", ("--steps", str(STEPS)), 1e-5, 1e-5, float32_noise=True),
    "fsdp2-bf16-reshard": Case("fsdp2.py", ("--steps", str(STEPS), "--bf16"), 1e-2, math.inf),
    "fsdp2-bf16-no-reshard": Case("fsdp2.py", ("--steps", str(STEPS), "--bf16", "--no-reshard-after-forward"),
                                  1e-2, math.inf),
    # one weight element whose AdamW steps nearly cancel ends 1e-5 of its norm away in fused mode: `each` 1e-4
    "fsdp-tp": Case("fsdp_tp.py", ("--dp", "{dp}"), 1e-5, 1e-4),  # 1 x 2 mesh at 2 ranks, 2 x 2 at 4
    "dcp": Case("fsdp2.py", ("--steps", str(STEPS)), 1e-5, 1e-5, checkpoint=True, float32_noise=True),
}


def check(case: Case, tpu: list[dict], gloo: list[dict]) -> list[str]:
    """What is wrong with a tpu run against gloo's, rank by rank (empty: it matches)."""
    problems = []
    for rank, (mine, ref) in enumerate(zip(tpu, gloo, strict=True)):
        losses, whole, errors = worst_loss_error(mine, ref), model_error(mine, ref), parameter_errors(mine, ref)
        each = float32_noise.bounds(len(tpu), STEPS, case.each) if case.float32_noise else {}
        over = {n: e / each.get(n, case.each) for n, e in errors.items()}
        worst = max(over, key=over.get)
        if losses >= case.tol or whole >= case.tol or over[worst] >= 1:
            problems.append(f"rank {rank}: losses {losses:.2g}, all parameters {whole:.2g}, "
                            f"{worst} {errors[worst]:.2g} (tolerance {case.tol:g}, "
                            f"each {each.get(worst, case.each):.2g})")
    # The ranks (or dp coordinates) saw their own batches and still hold one model.
    if any(r["params"] != tpu[0]["params"] for r in tpu):
        problems.append("the ranks' final parameters differ")
    return problems


def run_case(case: Case, nproc: int, mode: str, out: Path, gloo: list[dict] | None = None) -> list[str]:
    """The case on tpu in `mode` at `nproc` ranks against gloo (run here unless given); its problems."""
    args = case.arguments(nproc)
    timeout = 150 * nproc  # a 4-rank job took up to 3 minutes on the shared 2-core host (load 15)
    if gloo is None:
        gloo = run_ranks(case.example, args, out / "gloo", on="cpu", nproc=nproc, timeout=timeout)
    saving = ["--checkpoint", str(out / "ckpt"), "--save-at", str(SAVE_AT)] if case.checkpoint else []
    tpu = run_ranks(case.example, [*args, *saving], out / mode, on="tpu", env=MODES[mode], nproc=nproc,
                    timeout=timeout)
    problems = check(case, tpu, gloo)
    if case.checkpoint:
        resumed = run_ranks(case.example, [*args, "--checkpoint", str(out / "ckpt"), "--resume"],
                            out / f"{mode}-resumed", on="tpu", env=MODES[mode], nproc=nproc, timeout=timeout)
        tolerance = 0.0 if mode in EXACT_RESUME else RESUME_TOLERANCE
        for rank, (again, first) in enumerate(zip(resumed, tpu, strict=True)):
            uninterrupted = {"losses": first["losses"][SAVE_AT:], "params": first["params"]}
            if again["first_step"] != SAVE_AT or worst_loss_error(again, uninterrupted) > tolerance:
                problems.append(f"rank {rank}: resumed losses {again['losses']} where {first['losses'][SAVE_AT:]}")
            elif max(parameter_errors(again, uninterrupted).values()) > tolerance:
                problems.append(f"rank {rank}: resumed parameters differ from the uninterrupted run's: "
                                f"{max(parameter_errors(again, uninterrupted).values()):.2e} of their norm")
    return problems


def matrix(nprocs=(2, 4), cases=tuple(CASES), modes=tuple(MODES)) -> int:
    """Every case x mode x world size (gloo run once per case and world size); one line each, then a count."""
    passed = total = 0
    print(f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}, load {os.getloadavg()[0]:.1f} at the start", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for nproc in nprocs:
            for name in cases:
                case = CASES[name]
                out = Path(tmp) / f"{name}-{nproc}"
                gloo = run_ranks(case.example, case.arguments(nproc), out / "gloo", on="cpu", nproc=nproc)
                for mode in modes:
                    start = time.monotonic()
                    try:
                        problems = run_case(case, nproc, mode, out, gloo)
                    except AssertionError as e:  # the job failed: the tail of its stderr
                        problems = str(e).splitlines()[-15:] or ["failed"]
                    total += 1
                    passed += not problems
                    print(f"{name} x {mode} x {nproc} ranks: {'ok' if not problems else 'FAILED'} "
                          f"({time.monotonic() - start:.0f} s){''.join(chr(10) + '  ' + p for p in problems)}",
                          flush=True)
    print(f"{passed} of {total} passed ({datetime.now(timezone.utc):%H:%M UTC}, load {os.getloadavg()[0]:.1f})")
    return 0 if passed == total else 1


def main(argv: list[str]) -> int:
    """EXAMPLE NPROC [ARGS...]: run it on tpu (this environment's modes) and on gloo; print each rank's errors.
    --matrix [CASE...]: every case (all of CASES unless named) in every mode at 2 and 4 ranks."""
    if argv[:1] == ["--matrix"]:
        unknown = [c for c in argv[1:] if c not in CASES]
        if unknown:
            print(f"error: unknown case {unknown[0]!r} (cases: {', '.join(CASES)})", file=sys.stderr)
            return 2
        return matrix(cases=tuple(argv[1:]) or tuple(CASES))
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
