"""Public training scripts, copied unmodified (tests/data/public/, licences beside them), run under the tool as
their users run them, each against the same script run by plain PyTorch on the CPU (the tool off):

- PyTorch's word-language-model example (`main.py --accel`: the device is `torch.accelerator.current_accelerator()`),
  LSTM and Transformer, on word data made from this repository's README;
- PyTorch's DDP tutorial (`multigpu_torchrun.py`: `torch.cuda.set_device`, `init_process_group("nccl")`, integer
  device ids, `pin_memory`, a snapshot resumed with `map_location="cuda:N"`) under `--nproc 2 --device-map cuda=tpu`
  (in the release matrix, `-m matrix`);
- nanoGPT's `train.py` (CUDA as written: `torch.compile`, fused AdamW, bf16 autocast, a GradScaler, DDP, a checkpoint
  written from the compiled model and resumed) on a character dataset made from the README, at 1 and 2 ranks under
  `--device-map cuda=tpu` (2 ranks, bf16 autocast: in the release matrix).

The CPU references: the word-language-model and nanoGPT at one rank have CPU paths of their own (no `--accel`,
`--device=cpu`). A script that only runs on CUDA (the DDP tutorial, nanoGPT under torchrun) runs through
tests/support/public_launch.py `--cuda-on-cpu`, which names the CPU and gloo where the script names CUDA and NCCL.
The references run `--compile=False`: TorchInductor would need minutes of C++ compilation on this host, and it does
not change the math beyond float32 rounding.
"""

from __future__ import annotations

import math
import pickle
from concurrent.futures import ThreadPoolExecutor
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from support.paths import DATA, REPO
from support.processes import clean_env, run_python, run_tool

pytestmark = pytest.mark.slow  # process tests: each runs a script under the tool and on the CPU

PUBLIC = DATA / "public"
WORD_LM = PUBLIC / "pytorch_examples" / "word_language_model"
DDP_TUTORIAL = PUBLIC / "pytorch_examples" / "ddp_tutorial_series" / "multigpu_torchrun.py"
NANOGPT = PUBLIC / "nanogpt"
LAUNCH = REPO / "tests" / "support" / "public_launch.py"
TIMEOUT = 600
F32 = 1e-3  # a loss's absolute difference from the CPU's
BF16 = 1e-2  # relative, bf16 autocast against the CPU's bf16 autocast (8 bits of mantissa)


def _cpu_env() -> dict[str, str]:
    return clean_env(TPU_AGENT_DEVICE="off")


def _ok(proc, what: str) -> str:
    assert proc.returncode == 0, f"{what} failed:\n{proc.stderr[-6000:]}"
    return proc.stdout


def _both(first, second):
    """Two independent runs (the tool's and the CPU reference) at the same time: each mostly waits on one core."""
    with ThreadPoolExecutor(2) as pool:
        a, b = pool.submit(first), pool.submit(second)
        return a.result(), b.result()


def _readme_text() -> str:
    return (REPO / "README.md").read_text(encoding="utf-8")


# ---------------------------------------------------------------- PyTorch's word-language-model example


def _word_corpus(folder: Path, sizes=(480, 200, 200)) -> None:
    """train/valid/test.txt as data.Corpus reads WikiText-2: lines of words, from the README's lower-cased words."""
    words = re.findall(r"[a-z]+", _readme_text().lower())
    assert len(words) >= sum(sizes)
    folder.mkdir(parents=True)
    start = 0
    for name, count in zip(("train", "valid", "test"), sizes):
        part = words[start:start + count]
        start += count
        (folder / f"{name}.txt").write_text("".join(" ".join(part[i:i + 10]) + "\n" for i in range(0, count, 10)))


def _word_lm_dir(tmp_path: Path) -> Path:
    work = tmp_path / "word_language_model"
    shutil.copytree(WORD_LM, work)
    _word_corpus(work / "data")
    return work


def _word_lm_args(model: str) -> list[str]:
    """Tiny sizes; --dropout 0 so that the CPU's and the device's dropout masks (each device its own generator)
    do not differ; --log-interval 1 prints every batch's loss (as ppl, two decimals: 1e-5 of a loss)."""
    return ["--data", "data", "--model", model, "--emsize", "16", "--nhid", "16", "--nlayers", "2", "--nhead", "2",
            "--dropout", "0", "--epochs", "1", "--batch_size", "4", "--bptt", "10", "--lr", "2",
            "--log-interval", "1", "--save", "model.pt", "--accel"]


def _word_lm_losses(stdout: str) -> dict[str, list[float]]:
    """Each batch's training loss, the validation and the test loss, read back from the printed perplexities."""
    out = {"train": [], "valid": [], "test": []}
    for line in stdout.splitlines():
        ppl = re.search(r"ppl\s+([\d.]+)", line)
        if not ppl:
            continue
        kind = "valid" if "valid ppl" in line else "test" if "test ppl" in line else "train"
        out[kind].append(math.log(float(ppl.group(1))))
    return out


def _close(got: list[float], expected: list[float], tolerance: float, what: str, *, relative=False) -> None:
    assert len(got) == len(expected) > 0, f"{what}: {len(got)} values, the CPU printed {len(expected)}"
    for i, (a, b) in enumerate(zip(got, expected)):
        error = abs(a - b) / abs(b) if relative else abs(a - b)
        assert error <= tolerance, f"{what} {i}: tpu {a:.5f}, cpu {b:.5f} ({error:.2e} > {tolerance})"


def test_word_language_model_lstm_trains_evaluates_and_reloads_on_tpu_as_on_cpu(tmp_path):
    """`main.py --accel --model LSTM`: each batch's loss, the validation loss, and the test loss of the model
    saved with torch.save(model) and loaded back with torch.load (no map_location) within 1e-3 of the CPU's."""
    work = _word_lm_dir(tmp_path)
    (cpu_dir := tmp_path / "cpu").mkdir()
    shutil.copytree(work, cpu_dir, dirs_exist_ok=True)  # each run saves its own model.pt
    cpu, ours = _both(
        lambda: _ok(run_python("main.py", *_word_lm_args("LSTM"), cwd=cpu_dir, env=_cpu_env(), timeout=TIMEOUT), "cpu"),
        lambda: _ok(run_tool("run", "main.py", "--", *_word_lm_args("LSTM"), cwd=work, timeout=TIMEOUT),
                    "tpu-agent run"))
    assert "Using device: cpu" in cpu
    assert "Using device: tpu" in ours
    expected, got = _word_lm_losses(cpu), _word_lm_losses(ours)
    assert len(expected["train"]) == 13 and len(set(expected["train"])) == 13  # batch 0 is printed with batch 1
    for kind in ("train", "valid", "test"):
        _close(got[kind], expected[kind], F32, f"LSTM {kind} loss")


EVALUATE_ON_CPU = """\
import math, sys, torch
import data
from model import PositionalEncoding, TransformerModel
corpus = data.Corpus("data")
model = torch.load("model.pt", map_location="cpu", weights_only=False)
assert next(model.parameters()).device.type == "cpu"
criterion = torch.nn.NLLLoss()
ntokens, bptt = len(corpus.dictionary), 10
def batchify(ids, bsz):
    n = ids.size(0) // bsz
    return ids.narrow(0, 0, n * bsz).view(bsz, -1).t().contiguous()
def evaluate(source):  # main.py's evaluate(), as written
    model.eval()
    total = 0.
    with torch.no_grad():
        for i in range(0, source.size(0) - 1, bptt):
            seq_len = min(bptt, len(source) - 1 - i)
            x, y = source[i:i + seq_len], source[i + 1:i + 1 + seq_len].view(-1)
            total += len(x) * criterion(model(x).view(-1, ntokens), y).item()
    return total / (len(source) - 1)
print("valid", evaluate(batchify(corpus.valid, 10)))
print("test", evaluate(batchify(corpus.test, 10)))
"""


def test_word_language_model_transformer_evaluates_on_tpu_as_pytorch_does_on_cpu(tmp_path):
    """`main.py --accel --model Transformer`. The script builds nn.Transformer with its default dropout 0.1 (its
    --dropout reaches only the positional encoding), so the training batches' losses depend on the device's dropout
    masks and cannot match the CPU's. What must match: the validation and test losses the script prints on tpu
    (eval mode under no_grad: PyTorch's Transformer fast path, and the test pass on the model torch.load gives
    back) against plain PyTorch on the CPU evaluating the very model the tpu run saved."""
    work = _word_lm_dir(tmp_path)
    ours = _ok(run_tool("run", "main.py", "--", *_word_lm_args("Transformer"), cwd=work, timeout=TIMEOUT),
               "tpu-agent run")
    assert "Using device: tpu" in ours
    got = _word_lm_losses(ours)
    assert len(got["train"]) == 13 and all(math.isfinite(v) for v in got["train"])
    (work / "evaluate_on_cpu.py").write_text(EVALUATE_ON_CPU)
    cpu = _ok(run_python("evaluate_on_cpu.py", cwd=work, env=_cpu_env(), timeout=TIMEOUT), "evaluation on the CPU")
    expected = {k: [float(v)] for k, v in (line.split() for line in cpu.splitlines())}
    _close(got["valid"], expected["valid"], F32, "Transformer valid loss")
    _close(got["test"], expected["test"], F32, "Transformer test loss")


# ---------------------------------------------------------------- PyTorch's DDP tutorial (multigpu_torchrun.py)


def _tutorial(work: Path, total_epochs: int, *, on: str) -> str:
    """The tutorial at 2 ranks, batches of 512 (2 steps per epoch and rank), a snapshot every epoch; its data and
    model are drawn unseeded at start-up, so the launcher seeds torch's generator first (the same on both)."""
    args = ["--seed", "0", str(DDP_TUTORIAL), str(total_epochs), "1", "--batch_size", "512"]
    if on == "tpu":
        proc = run_tool("run", "--nproc", "2", "--device-map", "cuda=tpu", str(LAUNCH), "--", *args, cwd=work,
                        timeout=TIMEOUT)
    else:
        proc = run_python("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(LAUNCH),
                          "--cuda-on-cpu", *args, cwd=work, env=_cpu_env(), timeout=TIMEOUT)
    return _ok(proc, f"the DDP tutorial on {on}")


def _printed(stdout: str) -> list[str]:
    return sorted(line for line in stdout.splitlines() if line.startswith(("[GPU", "Epoch", "Loading", "Resuming")))


def _snapshot(path: Path) -> dict:
    snapshot = torch.load(path, map_location="cpu")
    return {"epochs": snapshot["EPOCHS_RUN"], **{k: v.clone() for k, v in snapshot["MODEL_STATE"].items()}}


# The release matrix (-m matrix, docs/ci.md): four 2-rank jobs whose GPU idioms the default pass runs elsewhere
# (tests/distributed/test_device_map_nccl.py: set_device, cuda:LOCAL_RANK, DDP(device_ids=...); nanoGPT below:
# init_process_group("nccl") through public_launch.py; tests/run/test_device_map.py: pin_memory, torch.load onto
# cuda); what only this test runs is a snapshot loaded with map_location="cuda:N" on each rank of a job.
@pytest.mark.matrix
def test_ddp_tutorial_trains_and_resumes_its_snapshot_on_tpu_as_on_cpu(tmp_path):
    """Two epochs, then a second job that resumes from the snapshot (each rank loads it with map_location="cuda:N")
    and runs to three. What the tutorial prints, and each snapshot, as on CPU gloo.

    The tutorial's loss is `F.cross_entropy` of one logit against float targets: log_softmax over one class is 0, so
    the loss and every gradient are exactly 0 on any device and the parameters keep their seeded initial values.
    The snapshots therefore check the initial broadcast, the saved and resumed state, not training arithmetic."""
    def both_jobs(on: str):
        work = tmp_path / on
        work.mkdir()
        first = _tutorial(work, 2, on=on)
        saved = _snapshot(work / "snapshot.pt")
        second = _tutorial(work, 3, on=on)
        return _printed(first), saved, _printed(second), _snapshot(work / "snapshot.pt")

    tpu, cpu = _both(lambda: both_jobs("tpu"), lambda: both_jobs("cpu"))
    assert tpu[0] == cpu[0] and "[GPU1] Epoch 1 | Batchsize: 512 | Steps: 2" in tpu[0]
    assert tpu[2] == cpu[2] and tpu[2].count("Resuming training from snapshot at Epoch 1") == 2
    for ours, reference in ((tpu[1], cpu[1]), (tpu[3], cpu[3])):
        assert ours.keys() == reference.keys() == {"epochs", "weight", "bias"}
        assert ours["epochs"] == reference["epochs"]
        for name in ("weight", "bias"):
            torch.testing.assert_close(ours[name], reference[name], rtol=1e-6, atol=1e-7)
    assert (tpu[1]["epochs"], tpu[3]["epochs"]) == (1, 2)


# ---------------------------------------------------------------- nanoGPT's train.py


def _char_dataset(folder: Path) -> int:
    """data/<dataset>/ as nanoGPT's shakespeare_char/prepare.py writes it, from the README's first 20000 characters:
    train.bin / val.bin (uint16 character ids, a 90 / 10 split) and meta.pkl (vocab_size, stoi, itos)."""
    text = _readme_text()[:20000]
    chars = sorted(set(text))
    stoi = {ch: i for i, ch in enumerate(chars)}
    ids = np.array([stoi[ch] for ch in text], dtype=np.uint16)
    folder.mkdir(parents=True)
    split = int(len(ids) * 0.9)
    ids[:split].tofile(folder / "train.bin")
    ids[split:].tofile(folder / "val.bin")
    with open(folder / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": stoi}, f)
    return len(chars)


def _nanogpt_dir(tmp_path: Path) -> Path:
    work = tmp_path / "nanogpt"
    work.mkdir()
    for name in ("train.py", "model.py", "configurator.py"):  # train.py exec()s configurator.py from the cwd
        shutil.copy(NANOGPT / name, work / name)
    _char_dataset(work / "data" / "readme_char")
    return work


# A tiny GPT, gradient accumulation over 2 micro-batches (1 per rank at 2 ranks), an evaluation every 2 iterations
# (with a checkpoint written from the compiled model), a learning rate that moves the loss in 4 iterations.
TINY = ["--dataset=readme_char", "--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=32", "--batch_size=4",
        "--gradient_accumulation_steps=2", "--max_iters=4", "--eval_interval=2", "--eval_iters=2", "--log_interval=1",
        "--learning_rate=0.01", "--warmup_iters=1", "--lr_decay_iters=10", "--min_lr=0.001"]

ITER = re.compile(r"^iter (\d+): loss ([\d.]+),", re.M)
EVAL = re.compile(r"^step (\d+): train loss ([\d.]+), val loss ([\d.]+)$", re.M)


def _nanogpt_losses(stdout: str) -> tuple[list[float], list[float]]:
    """Each iteration's training loss (the last micro-batch's, as train.py prints it) and the evaluations'
    train and val losses, in order."""
    iters = [float(loss) for _, loss in ITER.findall(stdout)]
    evals = [float(v) for _, train, val in EVAL.findall(stdout) for v in (train, val)]
    return iters, evals


def _nanogpt_tpu(work: Path, *args: str, nproc: int = 1) -> str:
    ranks = ["--nproc", str(nproc)] if nproc > 1 else []
    return _ok(run_tool("run", *ranks, "--device-map", "cuda=tpu", "train.py", "--", *TINY, *args, cwd=work,
                        timeout=TIMEOUT), "nanoGPT under tpu-agent run")


def _check_nanogpt(ours: str, reference: str, tolerance: float, *, relative: bool, iterations: int) -> None:
    (got_iters, got_evals), (iters, evals) = _nanogpt_losses(ours), _nanogpt_losses(reference)
    assert len(iters) == iterations, reference
    _close(got_iters, iters, tolerance, "iteration loss", relative=relative)
    _close(got_evals, evals, tolerance, "evaluation (train, val) loss", relative=relative)


def test_nanogpt_compiled_float32_one_rank_and_its_checkpoint_resumed(tmp_path):
    """`train.py --dtype=float32` (torch.compile, fused AdamW) on tpu against `--device=cpu`: every iteration's
    and evaluation's loss within 1e-3. Then `--init_from=resume` from the checkpoint the tpu run wrote from its
    compiled model (train.py strips PyTorch's `_orig_mod.` prefix), on tpu and in plain PyTorch on the CPU."""
    work = _nanogpt_dir(tmp_path)
    cpu, ours = _both(
        lambda: _ok(run_python("train.py", *TINY, "--dtype=float32", "--device=cpu", "--compile=False",
                               "--out_dir=cpu", cwd=work, env=_cpu_env(), timeout=TIMEOUT), "nanoGPT on the CPU"),
        lambda: _nanogpt_tpu(work, "--dtype=float32", "--out_dir=tpu"))
    assert "compiling the model" in ours
    _check_nanogpt(ours, cpu, F32, relative=False, iterations=5)
    keys = list(torch.load(work / "tpu" / "ckpt.pt", map_location="cpu", weights_only=False)["model"])
    assert keys and all(k.startswith("_orig_mod.") for k in keys), keys[:3]
    shutil.copytree(work / "tpu", work / "resume_cpu")
    resumed_cpu, resumed = _both(
        lambda: _ok(run_python("train.py", *TINY, "--dtype=float32", "--device=cpu", "--compile=False",
                               "--init_from=resume", "--max_iters=6", "--out_dir=resume_cpu", cwd=work,
                               env=_cpu_env(), timeout=TIMEOUT), "nanoGPT resumed on the CPU"),
        lambda: _nanogpt_tpu(work, "--dtype=float32", "--init_from=resume", "--max_iters=6", "--out_dir=tpu"))
    assert "Resuming training from tpu" in resumed
    _check_nanogpt(resumed, resumed_cpu, F32, relative=False, iterations=3)


@pytest.mark.matrix  # the default pass: nanoGPT at one rank (above); DDP as a GPU script writes it under --device-map
# (tests/distributed/test_device_map_nccl.py); bf16 autocast (tests/examples/test_autocast_cnn.py)
def test_nanogpt_bf16_autocast_ddp_two_ranks(tmp_path):
    """torchrun's 2 ranks: init_process_group("nccl"), cuda:LOCAL_RANK, DDP with require_backward_grad_sync toggled
    per micro-batch, bf16 autocast, torch.compile. Against the same at 2 ranks on CPU gloo under CPU bf16 autocast:
    every iteration's and evaluation's loss within bf16's tolerance."""
    work = _nanogpt_dir(tmp_path)
    cpu, ours = _both(
        lambda: _ok(run_python("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(LAUNCH),
                               "--cuda-on-cpu", "train.py", *TINY, "--dtype=bfloat16", "--compile=False",
                               "--out_dir=cpu", cwd=work, env=_cpu_env(), timeout=TIMEOUT),
                    "nanoGPT at 2 ranks on CPU gloo"),
        lambda: _nanogpt_tpu(work, "--dtype=bfloat16", "--out_dir=tpu", nproc=2))
    _check_nanogpt(ours, cpu, BF16, relative=True, iterations=5)
