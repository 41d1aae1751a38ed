"""Step time of tiny Hugging Face models on the tpu device, per execution mode, as ratios from one run.

    .venv/bin/python benchmarks/hf_speed.py [--families gpt2 vit llama] [--rounds 10] [--block 10] [--warmup 6]
                                            [--torch-threads N]

For each family (tests/support/hf_models.py, "sdpa" attention), builds the same seeded
model, AdamW optimizer and batch once per variant, and the script's plain step

    loss = model(**batch).loss; loss.backward(); opt.step(); opt.zero_grad(); loss.item()

run as: cpu eager (the reference), tpu eager (op by op), tpu fused (the step call inside
DEFER_AND_FUSE), tpu compiled (`torch.compile(step)`, the loss read outside it) and
tpu steps (the same unchanged step, `torch.tpu.compile_steps()` on while its first steps
run). Each variant warms up (compilation), then the variants run in rounds of blocks: a
block of --block steps of each variant per round (its first step untimed), the order
reversed every other round. Blocks, not single steps: switched at every step, XLA's and
PyTorch's thread pools fight over the cores and PyTorch's CPU steps look slower than they
are (issue #28). Prints median ms per step, each variant's ratio to cpu eager (median of
per-round ratios), programs per step, and issue #28's targets: compiled steps against
torch.compile(step) (1.1), fused against compiled (1.5), eager against fused (1.5), and the
best mode needing no change to the script against cpu eager (0.8).
These models are tiny: the times say more about per-op and per-step overhead than the math.
Loss agreement with the CPU is benchmarks/hf_models.py's job.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the support package

import torch  # noqa: E402

from _bench import (StepsReplays, add_threads_option, apply_threads_option, header, in_blocks, median_ms,  # noqa: E402
                    programs_line, programs_per_step, ratio, target)
from support import hf_models  # noqa: E402

VARIANTS = ["cpu eager", "tpu eager", "tpu fused", "tpu compiled", "tpu steps"]
NO_CHANGE = ["tpu eager", "tpu fused", "tpu steps"]  # modes that need no change to the script
STEPS_WARMUP = 6  # compile_steps: the first optimizer step runs as written, replays start around the 4th


def make_step(family: str, variant: str):
    device = "cpu" if variant == "cpu eager" else "tpu"
    model, opt, batch = hf_models.build(family, "sdpa", device)

    def step():
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    if variant == "tpu compiled":
        def body():  # .item() inside would cut the compiled step in two
            loss = model(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()

        compiled = torch.compile(body)
        return lambda: compiled().item()
    if variant == "tpu fused":
        def fused():
            with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
                return step()

        return fused
    return step


def measure(family: str, rounds: int, block: int, warmup: int) -> tuple[dict[str, list[float]], str]:
    steps = {}
    replays = StepsReplays()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in VARIANTS:
            steps[name] = make_step(family, name)
            if name == "tpu steps":
                torch.tpu.compile_steps(True)  # finds the next model called and optimizer stepped: this one
            try:
                for _ in range(max(warmup, STEPS_WARMUP) if name == "tpu steps" else warmup):
                    steps[name]()
            finally:
                if name == "tpu steps":
                    torch.tpu.compile_steps(False)  # what it found stays compiled
        replays.start()
        times = in_blocks(steps, rounds, block)
        note = replays.note(rounds * (block + 1))
        counts = {name: programs_per_step(step) for name, step in steps.items() if name != "cpu eager"}
    return times, note + "\n" + programs_line(counts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="*", default=["gpt2", "vit", "llama"], choices=list(hf_models.FAMILIES))
    parser.add_argument("--rounds", type=int, default=10, help="rounds (a block of steps of each variant per round)")
    parser.add_argument("--block", type=int, default=10, help="timed steps of a variant in a row, per round")
    parser.add_argument("--warmup", type=int, default=STEPS_WARMUP)
    add_threads_option(parser)
    args = parser.parse_args(argv)
    apply_threads_option(args)
    print(header(f"benchmarks/hf_speed.py: median step time (ms) over {args.rounds} rounds of {args.block}-step "
                 f"blocks per variant, after {args.warmup} warm-up steps, sdpa attention"), flush=True)
    for family in args.families:
        t, note = measure(family, args.rounds, args.block, args.warmup)
        print(f"\n{family}")
        for variant in VARIANTS:
            print(f"  {variant:13s} {median_ms(t[variant]):9.2f} ms   {ratio(t, variant, 'cpu eager'):6.2f}x cpu eager")
        print(note)
        best = min(NO_CHANGE, key=lambda v: median_ms(t[v]))
        print("  targets: " + ", ".join([
            target("steps/compiled", ratio(t, "tpu steps", "tpu compiled"), "<=", 1.1),
            target("fused/compiled", ratio(t, "tpu fused", "tpu compiled"), "<=", 1.5),
            target("eager/fused", ratio(t, "tpu eager", "tpu fused"), ">=", 1.5),
            f"steps/fused {ratio(t, 'tpu steps', 'tpu fused'):.2f}",
            target(f"best no-change mode ({best})/cpu eager", ratio(t, best, "cpu eager"), "<=", 0.8),
        ]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
