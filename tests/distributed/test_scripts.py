"""Distributed training scripts in the style users copy, on tpu against the same script on CPU gloo with the
tool off, rank by rank (issue #26 point 3): DDP (DistributedSampler, no_sync() accumulation), FSDP2
(`fully_shard` per block and on the root) in float32 and with MixedPrecisionPolicy(param_dtype=bfloat16,
reduce_dtype=float32) and `reshard_after_forward` both ways, 2-D FSDP2 x tensor parallel (ColwiseParallel /
RowwiseParallel) on a small Llama, and a `torch.distributed.checkpoint` save and reload of the sharded state
dict. Per-step losses and final parameters within 1e-5 relative (bf16: 1e-2); the cases and their
tolerances are tests/support/rank_runs.py's CASES.

Which combinations the default pass runs (world size per mode; a 4-rank job takes minutes on a 2-core host):
every kind at least once and every mode at least once, all at 2 ranks:

    case                        eager      fused      compiled
    ddp                         2 (d)                 2 (a)
    fsdp2 float32               (e)                   2 (b)
    fsdp2 bf16, no reshard                 2
    fsdp_tp (dp x tp)           2 (1x2, c)
    dcp save + resume                                 2 (b)

The release matrix, `-m matrix` (docs/ci.md), runs every case x mode at 2 and 4 ranks (the 2 x 2 fsdp_tp mesh
and the bf16 `reshard_after_forward=True` case among them) against gloo, as `cd tests && python -m
support.rank_runs --matrix` does by hand.

(a) tests/distributed/test_collectives.py: a DDP model under compiled steps against the same model on the CPU, in
its 2-rank job (examples/ddp.py under compiled steps against gloo, tests/distributed/test_ddp.py: in the matrix);
(b) one test against one gloo run: the compiled-steps run matches gloo, its AdamW program replays, and a fresh
compiled job resumes its checkpoint; (c) tests/plan/test_parallelism.py, whose run
without a plan is the reference of its exact parallelism plan (the 2 x 2 mesh, with its two groups in one program:
tests/distributed/test_two_groups_in_program.py); (d) tests/distributed/test_device_map_nccl.py: examples/ddp.py's
model and data as a GPU script writes it (its --device cuda), under --device-map cuda=tpu; (e) FSDP2 trained
eagerly on tpu (fully_shard per layer and on the root, AdamW) against the same model on the CPU given both ranks'
batches, at 2 ranks (tests/distributed/test_collectives.py), and at 4 ranks over two nodes against gloo
(tests/distributed/test_two_nodes.py); examples/fsdp2.py eagerly against gloo, its checkpoint saved and resumed by
a fresh eager job (the same losses and parameters to the last bit), are the matrix's fsdp2-eager-2 and dcp-eager-2.

The bfloat16 check depends on the device rounding as PyTorch does: the first test holds the ops where it did
not (a Linear's product rounded before its bias was added; gelu, softmax and layer norm's backward computed
in bfloat16), which took bf16 FSDP2 1.08e-2 away from gloo."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from support import float32_noise
from support.paths import EXAMPLES
from support.processes import clean_env, run_tool
from support.rank_runs import (CASES, MODES, RESUME_TOLERANCE, SAVE_AT, STEPS, check, model_error,
                               parameter_errors, run_case, run_ranks, worst_loss_error)


def _mismatches(tpu: torch.Tensor, reference: torch.Tensor) -> float:
    return (tpu.cpu() != reference).float().mean().item()


def test_bfloat16_ops_round_once_from_float32_as_pytorch_does():
    """Each op's bf16 result is its float32 result rounded once (before: 25-27 % of addmm's and gelu's
    outputs, 14-33 % of the layer-norm and softmax gradients differed by an ulp)."""
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*s, generator=g).bfloat16() for s in ((16, 64), (128, 64), (128,)))
    f32 = lambda t: t.float()  # noqa: E731
    to = lambda t: t.to("tpu")  # noqa: E731

    assert _mismatches(torch.addmm(to(b), to(x), to(w).T), (f32(b) + f32(x) @ f32(w).T).bfloat16()) == 0
    h = torch.randn(16, 128, generator=g).bfloat16()
    assert _mismatches(F.gelu(to(h)), F.gelu(f32(h)).bfloat16()) < 0.005
    assert _mismatches(F.log_softmax(to(h), -1), F.log_softmax(f32(h), -1).bfloat16()) < 0.005

    # The backward ops on the same bf16 inputs, against float32 kernels given those inputs.
    aten = torch.ops.aten
    dh = torch.randn(16, 128, generator=g).bfloat16()
    gamma = (1 + 0.1 * torch.randn(64, generator=g)).bfloat16()
    _, mean, rstd = aten.native_layer_norm(f32(x), [64], f32(gamma), f32(b[:64]), 1e-5)
    dy = dh[:, :64].contiguous()
    tpu_ln = aten.native_layer_norm_backward(to(dy), to(x), [64], to(mean), to(rstd), to(gamma), to(b[:64]), [True] * 3)
    ref_ln = aten.native_layer_norm_backward(f32(dy), f32(x), [64], mean, rstd, f32(gamma), f32(b[:64]), [True] * 3)
    out = F.log_softmax(h, -1)
    pairs = [*zip(tpu_ln, ref_ln),
             (aten.gelu_backward(to(dh), to(h)), aten.gelu_backward(f32(dh), f32(h))),
             (aten._log_softmax_backward_data(to(dh), to(out), 1, torch.bfloat16),
              aten._log_softmax_backward_data(f32(dh), f32(out), 1, torch.float32))]
    for i, (tpu, reference) in enumerate(pairs):
        assert tpu.dtype == torch.bfloat16, i
        assert _mismatches(tpu, reference.bfloat16()) < 0.005, i


COMBINATIONS = [  # (case, mode, world size): the default pass's, see the table above (dcp x compiled at 2
    ("fsdp2-bf16-no-reshard", "fused", 2),  # ranks: the compiled-steps test below, in its replays' run)
]
MATRIX = [(case, mode, nproc) for nproc in (2, 4) for case in CASES for mode in MODES
          if (case, mode, nproc) not in COMBINATIONS]


@pytest.mark.slow  # a job on tpu and one on gloo each (a minute or more each on a 2-core host)
@pytest.mark.parametrize("case, mode, nproc", [
    *COMBINATIONS, *(pytest.param(*c, marks=pytest.mark.matrix) for c in MATRIX)],
    ids=[f"{c}-{m}-{n}" for c, m, n in [*COMBINATIONS, *MATRIX]])
def test_script_matches_gloo_rank_by_rank(case, mode, nproc, tmp_path):
    """Each rank's per-step losses and all its final parameters together within the case's tolerance of
    gloo's (1e-5 relative, bf16 1e-2), each parameter within 1e-5 of its norm or, for fsdp2.py in float32,
    float32's own error there (support/float32_noise.py; at 4 ranks PyTorch's on blocks.2.up.weight is 1.26e-5) (fsdp_tp: 1e-4, one weight
    element whose AdamW steps nearly cancel; bf16: not checked one by one, a zero-initialised layer-norm bias
    ends 5e-2 of its norm away, as PyTorch's CPU kernel sums its gradient row by row in bf16); every rank ends
    with the same model; dcp: a fresh job resumes the checkpoint saved after step 3 with the uninterrupted
    run's losses and parameters (within 1e-6: under compiled steps the resumed first step runs as written where
    the uninterrupted run replays its one-program step, fused differently by XLA)."""
    problems = run_case(CASES[case], nproc, mode, tmp_path)
    assert not problems, "\n".join(problems)


_COUNT_REPLAYS = """\
import json, os, runpy, sys
from torch.optim.optimizer import register_optimizer_step_post_hook

optimizers = []
register_optimizer_step_post_hook(lambda opt, args, kwargs: optimizers.append(opt))
sys.argv = [sys.argv[1], *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
program = optimizers[-1].__dict__["_tpu_program"]
with open(f"replays{os.environ['RANK']}.json", "w") as f:
    json.dump({"replays": program.replays, "reason": program.reason_not_replayed}, f)
"""


@pytest.mark.slow  # two 2-rank jobs on tpu, one on gloo (about 50 s)
def test_fsdp2_under_compiled_steps_matches_gloo_and_a_compiled_job_resumes_its_dcp_checkpoint(tmp_path):
    """examples/fsdp2.py in float32 (fully_shard per block and on the root, reshard_after_forward=True) at 2 ranks
    under compiled steps (TPU_AGENT_COMPILE_STEPS=1), against gloo.

    AdamW's update over the DTensor parameters is one program, replayed from step 3 on, and each step's loss and
    every final parameter are within 1e-5 of gloo's, or float32's own error for that parameter (measured 2026-12-07
    with the tests' XLA flags: losses 2e-7, blocks.1.down.weight 1.89e-5 from gloo, bound 2.6e-5: the tpu run
    1.29e-5 from the float64 result, PyTorch's 5.97e-6, other float32 orders' up to 1.0e-5). Before, the capture
    failed in DTensor's sharding propagation (no Meta kernel for `_fused_adamw_.tensor_lr`); with that kernel alone
    each step captured anew, as FSDP2's gradients are new tensors each step and were read as storages. The same run
    saves a DCP checkpoint after step 3, and a fresh compiled job resumes it with the uninterrupted run's losses and
    parameters within 1e-6 (its first step runs as written where the uninterrupted run replays its one-program
    step, fused differently by XLA; measured at 4 ranks: 9.5e-8): the dcp x compiled case of the matrix at 2 ranks.

    The same script run eagerly against gloo, saving its checkpoint, and resumed by a fresh eager job (to the last
    bit) are the release matrix's fsdp2-eager-2 and dcp-eager-2 (measured 2026-12-04: 3.2e-7 and 6.9e-6 from gloo).
    The default pass trains FSDP2 eagerly on tpu elsewhere: fully_shard per layer and on the root with AdamW, at 2
    ranks, against the same model on the CPU given both ranks' batches (tests/distributed/test_collectives.py), and
    at 4 ranks over two nodes against gloo (tests/distributed/test_two_nodes.py)."""
    gloo = run_ranks("fsdp2.py", ["--steps", str(STEPS)], tmp_path / "gloo", on="cpu")
    bounds = float32_noise.bounds(2, STEPS, 1e-5)

    # Compiled steps, its AdamW program's replays counted in each rank, saving after step 3; then a fresh compiled
    # job resumes it.
    out = tmp_path / "compiled"
    out.mkdir()
    (tmp_path / "count_replays.py").write_text(_COUNT_REPLAYS)
    ckpt = ["--checkpoint", str(tmp_path / "compiled-ckpt")]
    proc = run_tool("run", "--nproc", "2", str(tmp_path / "count_replays.py"), "--",
                    str(EXAMPLES / "fsdp2.py"), "--steps", str(STEPS), "--out", str(out), *ckpt,
                    "--save-at", str(SAVE_AT), cwd=out, env=clean_env(TPU_AGENT_COMPILE_STEPS="1"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    tpu = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for rank in (0, 1):
        assert worst_loss_error(tpu[rank], gloo[rank]) < 1e-5, (rank, tpu[rank]["losses"], gloo[rank]["losses"])
        errors = parameter_errors(tpu[rank], gloo[rank])
        assert all(e < bounds[n] for n, e in errors.items()), (rank, errors, bounds)
        # step 1 creates the state as written, 2 and 3 are captured, 4-6 replay
        assert json.loads((out / f"replays{rank}.json").read_text()) == {"replays": STEPS - 3, "reason": None}
    # Each rank trained on its own batches, and the gradients were averaged: one model on both ranks.
    assert tpu[0]["losses"] != tpu[1]["losses"] and tpu[0]["params"] == tpu[1]["params"]
    assert (tmp_path / "compiled-ckpt" / ".metadata").exists()

    resumed = run_ranks("fsdp2.py", ["--steps", str(STEPS), *ckpt, "--resume"], tmp_path / "compiled-resumed",
                        on="tpu", env={"TPU_AGENT_COMPILE_STEPS": "1"})
    for rank in (0, 1):
        uninterrupted = {"losses": tpu[rank]["losses"][SAVE_AT:], "params": tpu[rank]["params"]}
        assert resumed[rank]["first_step"] == SAVE_AT
        assert worst_loss_error(resumed[rank], uninterrupted) <= RESUME_TOLERANCE, (rank, resumed[rank]["losses"])
        assert max(parameter_errors(resumed[rank], uninterrupted).values()) <= RESUME_TOLERANCE, rank


def test_the_device_trains_fsdp2s_model_within_float32s_own_error_of_the_exact_result():
    """The bound the float32 FSDP2 and DCP cases are held to (support/float32_noise.py): against the float64
    result of the same training (4 ranks' batches, gradients averaged, AdamW, 6 steps, in this process), each
    parameter of the tpu run is within twice the largest error of 8 CPU float32 runs summing in other orders
    (measured 2026-12-07: blocks.2.up.weight 1.38e-5, the CPU's 1.26e-5, the other orders' up to 1.8e-5). Before,
    the 4-rank compiled DCP case was held to 1e-5 per parameter, below PyTorch's own error on that parameter, and
    failed or passed with the rounding of one gradient (1e-05 with tolerance 1e-05 on all ranks; 2.25e-6 here
    with XLA's default flags, eager and compiled alike)."""
    exact = float32_noise.train(4, STEPS, torch.float64)
    pytorch, largest = float32_noise.errors(4, STEPS)
    device = float32_noise.relative(float32_noise.train(4, STEPS, torch.float32, "tpu"), exact)
    assert max(pytorch.values()) > 1e-5  # the case this is about: the CPU's own error over the old tolerance
    worse = {n: (device[n], largest[n]) for n in exact if device[n] > 2 * largest[n]}
    assert not worse, worse


def test_the_check_against_gloo_flags_a_loss_a_parameter_and_ranks_that_disagree():
    """What the script tests hold a run to (no processes): within tolerance passes; a loss or a parameter off
    by 3e-5, or ranks ending with different models, are each one problem named."""
    ref = {"losses": [1.0, 0.5], "params": {"w": [1.0, 2.0], "b": [3.0]}}
    near = {"losses": [1.0 + 1e-7, 0.5], "params": {"w": [1.0, 2.0 + 1e-7], "b": [3.0]}}
    case = CASES["fsdp2"]
    assert check(case, [near, near], [ref, ref]) == []
    off_loss = {**near, "losses": [1.0 + 3e-5, 0.5]}
    off_param = {**near, "params": {"w": [1.0, 2.0], "b": [3.0 + 1e-4]}}
    assert [p.split(":")[0] for p in check(case, [off_loss, off_loss], [ref, ref])] == ["rank 0", "rank 1"]
    problems = check(case, [near, off_param], [ref, ref])
    assert problems[0].startswith("rank 1:") and " b " in problems[0]
    assert problems[1] == "the ranks' final parameters differ"
    assert check(CASES["fsdp2-bf16-reshard"], [off_param, off_param], [ref, ref]) == []  # 1e-2 for bf16


def test_a_view_read_before_a_flush_that_did_not_compute_it_is_read_again():
    """Fused mode: the DCP resume's bug (FSDP2's `reset_sharded_param` takes `local_tensor.view(-1)` of a
    parameter `load_state_dict` had just copied a view into). The view of the copied view was recorded on a
    placeholder that the next flush consumed inside its graph without keeping its value; reading it later
    failed in the flush ('NoneType' object has no attribute 'inputs'). It now reads its base again."""
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
        source = torch.arange(8.0).to("tpu") * 2
        padded = torch.zeros(8, device="tpu")
        local = padded[:6]
        local.copy_(source[1:7])
        flat = local.view(-1)
        torch.tpu.synchronize()
        assert (flat + 1).cpu().tolist() == [3.0, 5.0, 7.0, 9.0, 11.0, 13.0]
