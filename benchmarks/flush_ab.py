"""The step flush's host time, two versions of backend/core/lazy.py in one process, alternating blocks of compiled steps.

    .venv/bin/python benchmarks/flush_ab.py OLD_LAZY_PY [--model gpt2_deep] [--rounds 6] [--block 10]

OLD_LAZY_PY is a copy of an earlier backend/core/lazy.py (e.g. `git show HEAD~1:backend/core/lazy.py > /tmp/old_lazy.py`):
its Recorder.flush, _donated and _compile replace the current ones for the "old" blocks (the module's other names
are the current module's, so both versions act on the same recorder and tensors). Per block: the host thread's
CPU time per step (thread_time around the step, the loss read outside it) and of the flushes alone. Prints the
medians of each and the per-round ratios new / old, with versions, date, load and commit.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import types
import warnings

import torch

from _bench import header
from replay import MODELS, Variant, commit, load

SHARED = ("Lazy", "Node", "Held", "Program", "STATE", "STATS", "launch", "mesh", "executables", "BREAK_REASONS",
          "GraphBreak", "Recompile", "_collect", "_aval_key", "user_frame", "device_x64", "_X64", "jax", "sys",
          "time", "weakref")


def old_recorder_methods(path: str) -> dict:
    from tpu_agent.backend.core import lazy

    source = open(path).read().split("\nRECORDER = Recorder()")[0]
    module = types.ModuleType(f"{lazy.__package__}._old_lazy")
    module.__package__ = lazy.__package__  # its relative imports are lazy.py's neighbours
    sys.modules[module.__name__] = module  # dataclasses look their module up
    ns = module.__dict__
    exec(compile(source, path, "exec"), ns)
    ns.update({k: getattr(lazy, k) for k in SHARED if hasattr(lazy, k)})
    return {name: ns["Recorder"].__dict__[name] for name in ("flush", "_donated", "_compile")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old")
    parser.add_argument("--model", default="gpt2_deep", choices=list(MODELS))
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from tpu_agent.backend.core import lazy

    print(header(f"benchmarks/flush_ab.py {args.old}: {args.model}, compiled steps, {args.rounds} rounds of "
                 f"{args.block}-step blocks, old and new flush alternating"))
    print(f"commit {commit()}  load {load()} before", flush=True)
    versions = {"new": {n: lazy.Recorder.__dict__[n] for n in ("flush", "_donated", "_compile")},
                "old": old_recorder_methods(args.old)}
    flush_s = [0.0]
    depth = [0]

    def timed(method):
        def flush(self, *a, **k):
            depth[0] += 1
            t0 = time.thread_time()
            try:
                return method(self, *a, **k)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    flush_s[0] += time.thread_time() - t0
        return flush

    def use(name):
        for attr, fn in versions[name].items():
            setattr(lazy.Recorder, attr, timed(fn) if attr == "flush" else fn)

    results = {"old": [], "new": []}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = Variant("tpu steps", args.model)
        torch.tpu.compile_steps(True)
        for name in ("old", "new"):
            use(name)
            for _ in range(args.warmup // 2):
                step()
        for r in range(args.rounds):
            for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
                use(name)
                step()  # the first step after a switch is not timed
                step.thread_s.clear()
                flush_s[0] = 0.0
                for _ in range(args.block):
                    step()
                results[name].append((statistics.median(step.thread_s), flush_s[0] / args.block))
        torch.tpu.compile_steps(False)
    for i, label in ((0, "host CPU per step"), (1, "flush CPU per step")):
        old = [x[i] for x in results["old"]]
        new = [x[i] for x in results["new"]]
        ratios = [n / o for n, o in zip(new, old)]
        print(f"{label:20} old {statistics.median(old) * 1e3:6.2f} ms  new {statistics.median(new) * 1e3:6.2f} ms  "
              f"new/old median {statistics.median(ratios):.3f} (rounds: {' '.join(f'{x:.2f}' for x in ratios)})")
    print(f"load {load()} after")
    return 0


if __name__ == "__main__":
    sys.exit(main())
