"""Every benchmark whose figures README.md and docs/benchmarks.md show, run by one command.

    .venv/bin/python benchmarks/run_all.py                  # each as docs/benchmarks.md quotes it: hours
    .venv/bin/python benchmarks/run_all.py --quick          # a smoke run of each that has one: 2-3 minutes
    .venv/bin/python benchmarks/run_all.py --list           # what runs, in which mode, with which arguments
    .venv/bin/python benchmarks/run_all.py --only dispatch backend   # some of them (names as --list gives them)

Each runs in a process of its own, as its figures were measured, from the checkout's root, with this Python.
Before its output come a line that names it and its command, and one with the date (UTC), the load average,
the commit (`+changes` when tracked files differ from it), the torch and jax versions and the CPU count;
the scripts' own header lines say the same with what they measure. At the end, a summary: each benchmark's
exit status and wall time. Run the full mode on a quiet machine: the figures are ratios from one run, but a
busy neighbour still moves them. `--quick` checks that each benchmark runs (tiny sizes, one round): its
figures mean nothing. The exit status is 1 when a benchmark failed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from _bench import environment  # noqa: E402


@dataclass(frozen=True)
class Benchmark:
    name: str
    what: str  # the figures it gives, and where docs/benchmarks.md shows them
    full: tuple[tuple[str, ...], ...]  # each command's arguments: `script args...`, or `-m module args...`
    quick: tuple[tuple[str, ...], ...] = ()  # empty: not run by --quick
    why_not_quick: str = ""
    env: dict[str, str] = field(default_factory=dict)


def _script(name: str, *args: str) -> tuple[str, ...]:
    return (f"benchmarks/{name}.py", *args)


TUNE = ("-m", "tpu_agent")  # `tpu-agent` with this Python

BENCHMARKS: tuple[Benchmark, ...] = (
    # --- the tpu device: speed ------------------------------------------------------------------------------
    Benchmark("dispatch", "per-op cost of x + y, x @ w and w.add_(y) against jax.jit ('The tpu device: speed')",
              (_script("dispatch"),), (_script("dispatch", "--rounds", "1", "--ops", "100"),)),
    Benchmark("bounded_graph", "fused mode's pending graph bounded in a loop with no sync ('The tpu device: speed')",
              (_script("bounded_graph"),), (_script("bounded_graph", "--iters", "10", "--rounds", "1"),)),
    Benchmark("backend", "the examples' steps in every mode against PyTorch CPU, torch.compile and JAX "
              "('The tpu device: speed')",
              (_script("backend", "--steps", "20"),),
              (_script("backend", "--steps", "1", "--warmup", "1", "--workloads", "mlp"),)),
    Benchmark("hf_speed", "tiny Hugging Face GPT-2, ViT, Llama steps per mode ('The tpu device: speed', "
              "'Compiled steps: where the time goes')",
              (_script("hf_speed", "--rounds", "8", "--block", "10"),),
              (_script("hf_speed", "--families", "gpt2", "--rounds", "1", "--block", "1", "--warmup", "1"),)),
    Benchmark("replay", "the host's cost per step of compiled steps ('Host cost of compiled steps')",
              (_script("replay", "--rounds", "4", "--block", "4", "--torch-threads", "1"),),
              (_script("replay", "--quick"),)),
    Benchmark("warmup", "first step, steps until compiling stops, memory ('Warm-up and memory')",
              (_script("warmup", "--steps", "200"),),
              (_script("warmup", "--families", "gpt2", "--modes", "eager", "--steps", "3"),)),
    Benchmark("hf_vocab", "GPT-2's vocabulary padded in the backend or the config ('A Hugging Face script')",
              (_script("hf_vocab", "--mode", "fused", "--rounds", "8"),),
              why_not_quick="GPT-2's full vocabulary in four variants: over a minute at its smallest"),
    # --- numerics ------------------------------------------------------------------------------------------
    Benchmark("hf_models", "tiny Hugging Face models' losses against the CPU, per mode ('Hugging Face models: "
              "losses against the CPU')",
              (_script("hf_models"),), (_script("hf_models", "--steps", "2", "--families", "gpt2"),)),
    Benchmark("unaligned_gqa_drift", "a Llama off every tile: loss drift from the CPU ('An unaligned GQA Llama')",
              tuple(_script("unaligned_gqa_drift", "--mode", mode) for mode in ("steps", "compiled", "eager", "fused"))
              + (_script("unaligned_gqa_drift", "--mode", "eager", "--fused-adamw"),
                 _script("unaligned_gqa_drift", "--size", "large", "--mode", "steps")),
              why_not_quick="20 AdamW steps of a Llama on the CPU and the device, minutes"),
    # --- distributed ---------------------------------------------------------------------------------------
    Benchmark("collectives", "all_reduce / all_gather bus bandwidth against gloo ('Collectives and a DDP step')",
              (_script("collectives"), _script("collectives", "--bare")),
              (_script("collectives", "--nproc", "2", "--max-mb", "1", "--rounds", "1"),)),
    Benchmark("collective_timing", "what the profiler's collective timing costs ('Timing collectives')",
              (_script("collective_timing", "--rounds", "9"),), (_script("collective_timing", "--rounds", "1"),)),
    Benchmark("ddp_step", "a DDP step on tpu against CPU gloo ('Collectives and a DDP step', 'Programs per step')",
              tuple(_script("ddp_step", "--nproc", n, "--mode", mode)
                    for n in ("2", "4") for mode in ("eager", "fused", "compiled")),
              (_script("ddp_step", "--nproc", "2", "--mode", "eager", "--steps", "1", "--batch", "8"),)),
    # --- the tool ------------------------------------------------------------------------------------------
    Benchmark("profile_overhead", "step time under `tpu-agent profile` against a plain run ('Profiler overhead')",
              (_script("profile_overhead"),),
              (_script("profile_overhead", "--examples", "mlp", "--steps", "4", "--warmup", "1", "--pairs", "1"),)),
    Benchmark("aa", "the verifier's false passes on no-op plans, and a real gain ('Verification statistics')",
              (_script("aa"),), why_not_quick="60 verifications per script, each a pair of processes"),
    Benchmark("pruners", "Optuna's median pruner against the Wilcoxon pruner ('Pruners')",
              (_script("pruners"), _script("pruners", "--examples", "odd_shapes", "cnn")),
              why_not_quick="a tune per pruner, minutes"),
    Benchmark("workers", "measured plans per hour with 1, 2 and 4 search workers ('Search workers')",
              (_script("workers"),), why_not_quick="three tunes of 14 trials"),
    Benchmark("tune_phases", "where a tune's wall time goes ('A nanoGPT-style script')",
              (_script("tune_phases", "tests/data/scripts/nanogpt_dict.py", "--", "--allow", "model", "--trials", "8",
                       "--offline"),),
              why_not_quick="a whole tune"),
    Benchmark("main_job", "the README's tune output ('The main job')",
              ((*TUNE, "tune", "examples/odd_shapes.py", "--trials", "20", "--offline", "--", "--steps", "60"),),
              why_not_quick="a whole tune, about 5 minutes"),
    # --- projection ----------------------------------------------------------------------------------------
    Benchmark("projection_table", "`tpu-agent project` against published MFU ('Pod-scale projection')",
              (_script("projection_table", "--cache", ".tpu-agent/projection-table"),),
              why_not_quick="models at their real size, traced: tens of minutes"),
    Benchmark("projection_rank", "the ranking `tune --target SLICE --slices N` makes ('The seed's scale')",
              (_script("projection_rank", "--budget", "4"),), env={"TPU_AGENT_XLA_CACHE": "off"},
              why_not_quick="a 235B model traced at real size"),
    Benchmark("projection_speed", "how long `tpu-agent project` takes ('Speed (issue #30...)')",
              (_script("projection_speed"),), why_not_quick="8B and 70B models traced at real size"),
)

# Named in docs/benchmarks.md but not benchmarks of their own: what runs them.
NOT_BENCHMARKS = {
    "run_all.py": "this command",
    "_bench.py": "what the benchmarks share (header, interleaved timing)",
    "projection_model.py": "the model script that projection_table.py and projection_rank.py run",
    "maxtext_trillium_model_configs.py": "MaxText's file (a source the projection table cites), not in this checkout",
    "step_profile.py": "a diagnostic: a cProfile of one compiled step (where replay.py's host time goes), no table",
    "flush_ab.py": "a change's before/after: it needs the old backend/core/lazy.py as an argument, so not of one commit",
}


def command(args: tuple[str, ...]) -> list[str]:
    return [sys.executable, *args]


def run(bench: Benchmark, quick: bool) -> tuple[int, float]:
    status, start = 0, time.perf_counter()
    for args in bench.quick if quick else bench.full:
        cmd = command(args)
        print(f"\n=== {bench.name}: {bench.what}\n$ {' '.join(cmd[1:])}"
              + "".join(f"  [{k}={v}]" for k, v in bench.env.items()), flush=True)
        print(environment(), flush=True)
        env = {**os.environ, **bench.env}
        env.setdefault("PYTHONUNBUFFERED", "1")
        code = subprocess.run(cmd, cwd=ROOT, env=env).returncode
        if code:
            print(f"--- {bench.name}: exit {code}", flush=True)
            status = status or code
    return status, time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run of each benchmark that has one")
    parser.add_argument("--list", action="store_true", help="print what would run, run nothing")
    parser.add_argument("--only", nargs="+", metavar="NAME", choices=[b.name for b in BENCHMARKS],
                        help="run these benchmarks only")
    args = parser.parse_args(argv)
    chosen = [b for b in BENCHMARKS if not args.only or b.name in args.only]
    if args.list:
        for b in chosen:
            commands = b.quick if args.quick else b.full
            print(f"{b.name}: {b.what}")
            for c in commands:
                print("    " + " ".join(c) + "".join(f"  [{k}={v}]" for k, v in b.env.items()))
            if not commands:
                print(f"    (not in --quick: {b.why_not_quick})")
        return 0
    print(f"benchmarks/run_all.py{' --quick' if args.quick else ''}: {len(chosen)} benchmark(s)\n{environment()}",
          flush=True)
    results = {}
    for b in chosen:
        if args.quick and not b.quick:
            continue
        results[b.name] = run(b, args.quick)
    print(f"\n=== summary{' (--quick: smoke runs, no figures)' if args.quick else ''}\n{environment()}")
    for name, (code, seconds) in results.items():
        print(f"{name:<20} {'ok' if code == 0 else f'FAILED (exit {code})':<16} {seconds:8.1f} s")
    for b in chosen:
        if b.name not in results:
            print(f"{b.name:<20} {'not in --quick':<16} {b.why_not_quick}")
    return 1 if any(code for code, _ in results.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
