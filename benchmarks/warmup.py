"""Warm-up and memory of tiny Hugging Face training steps, reported as TorchTPU reports its benchmarks.

    .venv/bin/python benchmarks/warmup.py [--families gpt2 llama vit] [--modes eager fused steps] [--steps 200]

Each (family, mode) is one `tpu-agent profile` of an unmodified loop (forward, backward, AdamW step,
zero_grad, the loss read), `--steps N` measured steps after a 2-step warm-up, in its own process: the
profile's warm-up section gives the first step's time (FlopCounterMode runs in it, for the profiler's
FLOP cross-check), the steps until compiling stopped and their overhead above as many steady steps, the
steady step time, the programs compiled, peak device memory and live memory's growth per steady step
(issue #28 point 5: flat over 200 steps). `steps` is compiled steps (TPU_AGENT_COMPILE_STEPS=1). Absolute
times depend on the machine's load: the command prints `uptime`'s load before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = """\
    import sys
    sys.path.insert(0, {tests!r})
    import torch
    from support import hf_models

    model, opt, batch = hf_models.build({family!r}, "sdpa", "tpu")
    for _ in range({total}):
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss.item()
"""
MODES = {"eager": (["--mode", "eager"], {}), "fused": (["--mode", "fused"], {}),
         "steps": (["--mode", "fused"], {"TPU_AGENT_COMPILE_STEPS": "1"})}


def profile(family: str, mode: str, steps: int, work: Path) -> dict:
    script = work / f"{family}.py"
    script.write_text(textwrap.dedent(SCRIPT.format(tests=str(ROOT / "tests"), family=family, total=steps + 8)))
    args, env = MODES[mode]
    cmd = [str(ROOT / ".venv/bin/tpu-agent"), "profile", str(script), "--json", "--no-dump-hlo",
           "--steps", str(steps), "--host-device-steps", "0", *args]
    proc = subprocess.run(cmd, cwd=work, env={**os.environ, **env}, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{family} {mode}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout)


def load() -> str:
    return Path("/proc/loadavg").read_text().split()[0]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=["gpt2", "llama", "vit"])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--steps", type=int, default=200)
    a = parser.parse_args(argv)
    print(f"benchmarks/warmup.py --steps {a.steps}: load {load()} before")
    print(f"{'model':7} {'mode':6} {'first step':>11} {'compiling':>10} {'overhead':>10} {'steady':>9} "
          f"{'programs':>8} {'peak':>10} {'growth/step':>12} flat")
    with tempfile.TemporaryDirectory() as tmp:
        for family in a.families:
            for mode in a.modes:
                p = profile(family, mode, a.steps, Path(tmp))
                w = p["warmup"]
                peak = f"{w['peak_bytes'] / 2**20:.2f} MiB" if w["peak_bytes"] else "n/a"
                growth = (f"{w['live_growth_bytes_per_step']:.0f} B" if w["live_growth_bytes_per_step"] is not None
                          else "n/a")
                over = f"{w['overhead_s']:.2f} s" if w["overhead_s"] is not None else "n/a"
                steady = f"{w['steady_step_s'] * 1e3:.2f} ms" if w["steady_step_s"] is not None else "n/a"
                print(f"{family:7} {mode:6} {w['first_step_s']:10.2f}s {'step ' + str(w['compiling_steps']):>10} "
                      f"{over:>10} {steady:>9} {w['programs_compiled']:>8} {peak:>10} {growth:>12} "
                      f"{w['memory_flat']} ({w['steady_steps']} steps)", flush=True)
    print(f"load {load()} after")
    return 0


if __name__ == "__main__":
    sys.exit(main())
