"""Validation of `tpu-agent project` against published MFU: each row a PyTorch model at its real size (Hugging Face
Llama config, meta init; benchmarks/projection_model.py) with the published slice, mesh and batch.

    .venv/bin/python benchmarks/projection_table.py [--cache DIR] [--rows NAME,...]

Rows marked `fit` set the cost model's one fitted constant per generation (MXU efficiency, solved so the fit row's
projected MFU equals the published one); `check` rows are projected with those constants and never move them;
`blind` rows were added after the cost model was frozen (tpu_agent/project at 37f04f2, its costs those of 9fbb20f):
their errors are recorded as they came out, and they are kept apart from the check rows' figures.
Published MFU counts full (non-causal) attention FLOPs, as MaxText did before July 2025, which the projection does too.
Partitioned programs are cached as JSON in --cache so a re-fit does not re-trace.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from tpu_agent.backend.generations import GENERATIONS
from tpu_agent.project import cost, run, slices
from tpu_agent.project.results import Partitioned

MODEL = str(Path(__file__).with_name("projection_model.py"))
V5E = "https://github.com/AI-Hypercomputer/maxtext/blob/main/MaxText/configs/v5e/README.md"
V5P = "https://github.com/AI-Hypercomputer/maxtext/blob/main/docs/reference/performance_metrics.md (TPU v5p table)"
V6E = "https://github.com/AI-Hypercomputer/maxtext/blob/main/docs/reference/models/tiering.md (Trillium, Gold)"


def maxtext(scale: int) -> list[str]:
    """MaxText's base.yml model (emb 2048, 16 heads of 128, mlp 7168, 16 layers, vocab 32000) scaled by
    global_parameter_scale as pyconfig.get_individual_scales does."""
    import math

    log2 = int(math.log2(scale))
    base, rem = divmod(log2, 3)
    heads = 16 * 2 ** (base + int(rem > 0))
    mlp = 7168 * 2 ** (base + int(rem > 0))
    emb = 2048 * 2 ** (base + int(rem > 1))
    layers = 16 * 2 ** base
    return ["--hidden", str(emb), "--heads", str(heads), "--mlp", str(mlp), "--layers", str(layers), "--vocab", "32000"]


LLAMA31_8B = ["--hidden", "4096", "--heads", "32", "--kv-heads", "8", "--mlp", "14336", "--layers", "32",
              "--vocab", "128256"]
LLAMA31_70B = ["--hidden", "8192", "--heads", "64", "--kv-heads", "8", "--mlp", "28672", "--layers", "80",
               "--vocab", "128256"]
MIXTRAL_8X7B = ["--hidden", "4096", "--heads", "32", "--kv-heads", "8", "--mlp", "14336", "--layers", "32",
                "--vocab", "32000", "--experts", "8", "--top-k", "2", "--capacity-factor", "1.25"]
RECIPE_MIXTRAL = ("https://github.com/AI-Hypercomputer/tpu-recipes/tree/main/training/trillium/Mixtral-8x7B-MaxText "
                  "(MaxText@tpu-recipes-v0.1.2 mixtral_8x7b_dropped: per_device_batch_size 12, ici_fsdp -1, "
                  "max_target_length 4096, capacity_factor 1.25, megablox False, remat custom offloading "
                  "decoder_layer_input, q/k/v and out_proj; its log: 13.484 s, 302.311 TFLOP/s/device)")
LLAMA2_70B = ["--hidden", "8192", "--heads", "64", "--kv-heads", "8", "--mlp", "28672", "--layers", "80",
              "--vocab", "32000"]
RECIPE_L2_70B = ("https://github.com/AI-Hypercomputer/tpu-recipes/tree/main/training/trillium/Llama2-70B-MaxText "
                 "(MaxText@tpu-recipes-v0.1.2 llama2_70b_4096_sc: ici_fsdp_transpose_parallelism -1, remat "
                 "qkv_proj_offloaded, max_target_length 4096; its log: 9.052 s, 402.274 TFLOP/s/device, total_weights "
                 "2097152, i.e. 2 sequences per device where the config reads 3); " + V6E + " (Gold: 43.8%)")
TORCHPRIME = ("https://github.com/AI-Hypercomputer/torchprime/issues/16 (PyTorch/XLA 2.6.0, torchprime: Llama 3.0 "
              "8B, sequence 8192, global batch 256 on one v6e-256: 1.625 s per step, 512: 2.991 s); recipe: torchprime/torch_xla_models/"
              "README.md 'Llama 3.0 8B on v6e-256' (ici_mesh.fsdp=256, remat llama-scan: every decoder layer "
              "checkpointed; Adafactor, modelled here as AdamW)")
RECIPE_70B = ("https://github.com/AI-Hypercomputer/tpu-recipes/tree/main/training/trillium/Llama3.1-70B-MaxText "
              "(MaxText@tpu-recipes-v0.1.4 llama3_1_70b_8192: per_device_batch_size 5; its log: 462.297 TFLOP/s/device)")

# name, role, slice, mesh, model args, per-chip batch, seq, remat (projection_model.py --remat: MaxText's
# remat_policy full -> full, minimal and minimal_offloaded -> minimal, custom keeping the layer input and q/k/v
# -> qkv), published MFU, source (config file)
ROWS = [
    ("maxtext-32b-v5e", "fit", "v5e-256", {"fsdp": 256}, maxtext(32), 4, 2048, "full", 66.86,
     V5E + "; configs/v5e/32b.sh"),
    ("maxtext-16b-v5e", "check", "v5e-256", {"fsdp": 256}, maxtext(16), 6, 2048, "full", 61.10,
     V5E + "; configs/v5e/16b.sh"),
    ("maxtext-64b-v5e", "check", "v5e-256", {"fsdp": 256}, maxtext(64), 2, 2048, "full", 59.90,
     V5E + "; configs/v5e/64b.sh"),
    ("maxtext-128b-v5e", "check", "v5e-256", {"fsdp": 16, "tensor": 16}, maxtext(128), 1, 2048, "minimal", 56.06,
     V5E + "; configs/v5e/128b.sh (minimal_offloaded)"),
    ("maxtext-32b-v5p", "fit", "v5p-128", {"fsdp": 16, "tensor": 4}, maxtext(32), 6, 2048, "minimal", 71.47,
     V5P + "; configs/v5p/32b.sh"),
    ("maxtext-64b-v5p", "check", "v5p-128", {"fsdp": 16, "tensor": 4}, maxtext(64), 3, 2048, "minimal", 70.31,
     V5P + "; configs/v5p/64b.sh"),
    ("maxtext-128b-v5p", "check", "v5p-256", {"fsdp": 16, "tensor": 8}, maxtext(128), 1, 2048, "minimal", 68.68,
     V5P + "; configs/v5p/128b.sh"),
    ("llama3.1-8b-v6e", "fit", "v6e-256", {"fsdp": 256}, LLAMA31_8B, 4, 8192, "qkv", 45.46,
     V6E + "; benchmarks/maxtext_trillium_model_configs.py llama3_1_8b_8192 (remat custom)"),
    ("llama3.1-70b-v6e", "check", "v6e-256", {"fsdp": 256}, LLAMA31_70B, 5, 8192, "qkv", 50.33,
     V6E + "; " + RECIPE_70B),
    # 302.311 TFLOP/s/device / 918 peak; MaxText counts an MoE's FLOPs with the top_k experts a token uses (its
    # "dropless" count: no capacity padding, no dispatch or combine einsums), so the row's projected MFU is taken
    # in the published count: published MFU x published step / projected step (PUBLISHED_STEP_S).
    ("mixtral-8x7b-v6e", "blind", "v6e-256", {"fsdp": 256}, MIXTRAL_8X7B, 12, 4096, "mlp", 32.93, RECIPE_MIXTRAL),
    # The recipe's log ran 2 sequences per device (total_weights 2097152 = 256 x 2 x 4096; 905.021 tokens/s/device x
    # 9.052 s = 8192) where its config reads per_device_batch_size 3: the log's batch, the config's other settings.
    ("llama2-70b-v6e", "blind", "v6e-256", {"fsdp": 256}, LLAMA2_70B, 2, 4096, "qkv", 43.82, RECIPE_L2_70B),
    # PyTorch/XLA: a step time, no MFU published; MFU is the projection's own FLOP count over the published step.
    ("torchprime-llama3-8b-v6e", "blind", "v6e-256", {"fsdp": 256}, LLAMA31_8B, 1, 8192, "full", None,
     TORCHPRIME + "; global batch 256"),
    ("torchprime-llama3-8b-b2-v6e", "blind", "v6e-256", {"fsdp": 256}, LLAMA31_8B, 2, 8192, "full", None,
     TORCHPRIME + "; global batch 512: 2.991 s"),
]
# Rows whose source gives the step time: projected MFU = published MFU x published step / projected step, so the
# FLOPs are counted as the publisher counted them (or, with no published MFU, as the projection counts them).
PUBLISHED_STEP_S = {"mixtral-8x7b-v6e": 13.484, "torchprime-llama3-8b-v6e": 1.625, "torchprime-llama3-8b-b2-v6e": 2.991}


def partitioned(row, cache: Path) -> tuple[Partitioned, float]:
    name, _role, target, mesh, model, per_chip, seq, remat, *_ = row
    path = cache / f"{name}.json"
    if path.exists():
        data = json.loads(path.read_text())
        return Partitioned.model_validate(data["partitioned"]), data["wall_s"]
    sl = slices.parse(target)
    args = [*model, "--batch", str(per_chip * sl.chips), "--seq", str(seq), "--remat", remat]
    t0 = time.perf_counter()
    part = run.partition(MODEL, args, sl, mesh)
    wall = time.perf_counter() - t0
    path.write_text(json.dumps({"partitioned": part.model_dump(), "wall_s": wall}))
    return part, wall


def fit(part: Partitioned, sl, published: float) -> float:
    lo, hi = 0.05, 1.5
    for _ in range(60):
        mid = (lo + hi) / 2
        cost.MXU_EFFICIENCY[sl.generation] = mid
        if cost.project(part, sl).mfu * 100 < published:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--cache", default=".tpu-agent/projection-table")
    p.add_argument("--rows", default="")
    a = p.parse_args()
    cache = Path(a.cache)
    cache.mkdir(parents=True, exist_ok=True)
    rows = [r for r in ROWS if not a.rows or r[0] in a.rows.split(",")]
    parts = {}
    for row in rows:
        parts[row[0]] = partitioned(row, cache)
        print(f"traced {row[0]} in {parts[row[0]][1]:.0f} s", file=sys.stderr, flush=True)
    fitted = dict(cost.MXU_EFFICIENCY)
    for row in rows:
        if row[1] == "fit":
            fitted[slices.parse(row[2]).generation] = fit(parts[row[0]][0], slices.parse(row[2]), row[8])
    cost.MXU_EFFICIENCY.update(fitted)
    print("| row | role | slice | mesh | per-chip batch x seq | remat | projected MFU | published MFU | error (points) "
          "| fits HBM | traced in | source |")
    print("|---|---|---|---|---|---|---:|---:|---:|---|---:|---|")
    errors, blind = [], []
    for row in rows:
        name, role, target, mesh, _model, per_chip, seq, remat, published, source = row
        sl = slices.parse(target)
        part, wall = parts[name]
        proj = cost.project(part, sl)
        mfu = proj.mfu * 100
        if name in PUBLISHED_STEP_S:
            step = PUBLISHED_STEP_S[name]
            if published is None:
                published = proj.model_flops / (step * GENERATIONS[sl.generation].peak_bf16_flops * sl.chips) * 100
            mfu = published * step / proj.step_s
        err = mfu - published
        (errors if role == "check" else blind if role == "blind" else []).append(abs(err))
        print(f"| {name} | {role} | {target} | {','.join(f'{k}={v}' for k, v in mesh.items())} | {per_chip} x {seq} | "
              f"{remat} | {mfu:.1f}% | {published:.2f}% | {err:+.1f} | "
              f"{'yes' if proj.fits else 'no'} ({proj.hbm_bytes_per_chip / 2**30:.1f} GiB) | {wall:.0f} s | {source} |")
    print()
    print("fitted MXU efficiency per generation: " + ", ".join(f"{g} {fitted[g]:.3f}" for g in sorted(
        {slices.parse(r[2]).generation for r in rows})))
    if errors:
        print(f"check rows: {len(errors)}; median |error| {statistics.median(errors):.1f} points, largest "
              f"{max(errors):.1f} (goal: median <= 5, none > 12)")
    if blind:
        print(f"blind rows (added after the cost model was frozen): {len(blind)}; |error| "
              + ", ".join(f"{e:.1f}" for e in blind) + f"; check and blind rows together: median "
              f"{statistics.median(errors + blind):.1f}, largest {max(errors + blind):.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
