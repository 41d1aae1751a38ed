"""examples/hf_trainer.py (transformers.Trainer) and examples/accelerate_loop.py (Accelerate), unchanged: the
same losses under `tpu-agent run` (on tpu) as under plain python on the CPU, checkpoints and resume included (the
resumed run under `tpu-agent profile`, which shows its device figures); and which device Trainer and Accelerate
pick, in the tool's child and outside it."""

from __future__ import annotations

import json
import re
import shutil
import textwrap
from pathlib import Path

import pytest

from support.examples import RUN_EACH
from support.paths import EXAMPLES
from support.processes import clean_env, run_python, run_tool

LINE = re.compile(r"^step=(\d+) (loss|eval_loss)=(\S+)$", re.M)
REL = 1e-4  # fp32: the same math on two devices

# Which device each picks when nothing names one (TrainingArguments asks Accelerate's PartialState).
PROBE = """\
from accelerate import Accelerator
from transformers import TrainingArguments

args = TrainingArguments(output_dir="out", report_to="none")
print(f"trainer={args.device.type} accelerate={Accelerator().device.type}")
"""

def _before_the_tool() -> dict[str, str]:
    """Plain python with the bundled device off: the CPU reference, as before the tool was installed."""
    return clean_env(TPU_AGENT_DEVICE="off")


def logged(stdout: str) -> dict[tuple[int, str], float]:
    """(step, "loss" | "eval_loss") -> value, from the example's own lines."""
    return {(int(step), kind): float(value) for step, kind, value in LINE.findall(stdout)}


def device(stdout: str) -> str:
    (found,) = re.findall(r"^device=(\w+)$", stdout, re.M)
    return found


# Before the tool both pick the CPU, and in the tool's child both pick tpu: the two examples' runs below check it
# (neither names a device: TrainingArguments and Accelerator() pick it, and each prints `device=`).


def test_under_plain_python_both_pick_the_cpu_and_a_script_that_used_tpu_finds_it_available(tmp_path):
    """One plain python run with the tool installed: Trainer and Accelerate pick the CPU; the device is not hidden
    from a script that names it: after its first tpu tensor, tpu is the accelerator."""
    path = tmp_path / "probe.py"
    path.write_text("import torch\nprint(torch.accelerator.is_available(), torch.tpu.is_available())\n"
                    + textwrap.dedent(PROBE)
                    + "torch.ones(1, device='tpu')\nprint(torch.accelerator.is_available(), torch.tpu.is_available())\n")
    proc = run_python(str(path), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["False", "False", "trainer=cpu", "accelerate=cpu", "True", "True"]


def _profiled(script: str, args: list[str], cwd: Path):
    """The example under `tpu-agent profile` (fused mode, its own default) to its end: its stdout carries the
    script's lines, then the profile's."""
    proc = run_tool("profile", script, "--warmup", "1", "--host-device-steps", "0", "--", *args, cwd=cwd,
                    timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # device figures are printed only for a profile in which the model's executables ran on tpu
    assert "MFU" in proc.stdout and "ran on the tpu device" not in proc.stdout + proc.stderr
    assert "error" not in proc.stderr.lower(), proc.stderr[-3000:]
    return proc


def _compare(cpu: dict, tpu: dict, steps) -> None:
    for key in steps:
        assert tpu[key] == pytest.approx(cpu[key], rel=REL), (key, cpu[key], tpu[key])


# A Trainer script in the shape of the HF fine-tuning guides, for the other model kinds: a causal LM with GQA and
# RoPE (Llama) and image classification (ViT), each built from a tiny config; the families named run one after
# the other in one process (one start-up of Python, torch and transformers for both), each seeded afresh.
FAMILY_TRAINER = """\
import sys

import torch
from torch.utils.data import Dataset
from transformers import (LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments, ViTConfig,
                          ViTForImageClassification)


class Rows(Dataset):
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


for family in sys.argv[1:]:
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(0)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=64))
        ids = torch.randint(0, 128, (32, 16), generator=g)
        rows = [{"input_ids": i, "labels": i} for i in ids]
    else:
        model = ViTForImageClassification(ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32,
                                                    num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                                    num_labels=10, hidden_dropout_prob=0.0,
                                                    attention_probs_dropout_prob=0.0))
        pixels, labels = torch.randn(32, 3, 16, 16, generator=g), torch.randint(0, 10, (32,), generator=g)
        rows = [{"pixel_values": p, "labels": y} for p, y in zip(pixels, labels)]
    args = TrainingArguments(output_dir=f"out-{family}", max_steps=4, per_device_train_batch_size=4,
                             gradient_accumulation_steps=2, logging_steps=1, eval_strategy="steps", eval_steps=4,
                             save_steps=4, report_to="none", seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=Rows(rows[:24]), eval_dataset=Rows(rows[24:]))
    trainer.train()
    print(f"family={family}")
    print(f"device={args.device.type}")
    for entry in trainer.state.log_history:
        for kind in ("loss", "eval_loss"):
            if kind in entry:
                print(f"step={entry['step']} {kind}={entry[kind]:.6f}")
"""
FAMILIES = ["llama", "vit"]


def by_family(stdout: str) -> dict[str, str]:
    """Each family's lines of the script's stdout, from its `family=` line to the next."""
    parts = re.split(r"^family=(\w+)$", stdout, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def _cpu_references(tmp_path: Path, family_script: Path) -> dict[str, str]:
    """The three scripts' CPU references (plain python, the tool's device off) one after the other in one process
    (support/examples.py's RUN_EACH: one start-up of Python, torch, transformers and Accelerate for all, where each
    start-up is most of a run), each as `python SCRIPT ARGS` runs it, its stdout alone. Each seeds itself: the
    losses are those of a process of its own (accelerate_loop first: its Accelerator(gradient_accumulation_steps=2)
    sets Accelerate's state, which the Trainers after it take as they find it)."""
    runs = {"accelerate": [str(EXAMPLES / "accelerate_loop.py"), "--steps", "8"],
            "trainer": [str(EXAMPLES / "hf_trainer.py"), *TRAINER_ARGS],
            "families": [str(family_script), *FAMILIES]}
    (tmp_path / "cpu").mkdir()
    proc = run_python("-c", RUN_EACH, json.dumps(list(runs.values())), cwd=tmp_path / "cpu",
                      env=_before_the_tool(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(zip(runs, json.loads(proc.stdout.splitlines()[-1])))


TRAINER_ARGS = ["--steps", "8", "--save-steps", "4"]


@pytest.mark.slow
def test_trainer_accelerate_and_other_model_kinds_match_their_cpu_losses_with_checkpoints_and_resume(tmp_path):
    """The CPU references of examples/hf_trainer.py, examples/accelerate_loop.py and the Trainer script for Llama
    and ViT (FAMILY_TRAINER), made in one process (_cpu_references), then each under the tool, checked part by
    part:
    - hf_trainer.py: Trainer picks the CPU before the tool and tpu in the tool's child, with the same losses and
      eval losses there; resumed from checkpoint-4 under the profiler (fused mode), steps 5-8 and the eval as the
      uninterrupted run, with the profile's device figures.
    - accelerate_loop.py: Accelerate picks the CPU before the tool and tpu in the tool's child, with the same losses
      and no warning; load_state of what save_state wrote at step 4, under the profiler, steps 5-8 and the eval as
      the uninterrupted run, with the profile's device figures.
    - Llama and ViT under Trainer: each family's losses and eval loss on tpu as on the CPU, its checkpoint written
      in the tpu run's own directory."""
    family_script = tmp_path / "trainer.py"
    family_script.write_text(FAMILY_TRAINER)
    cpu = _cpu_references(tmp_path, family_script)
    (tmp_path / "tpu").mkdir()

    # hf_trainer.py
    script = str(EXAMPLES / "hf_trainer.py")
    assert device(cpu["trainer"]) == "cpu"
    expected = logged(cpu["trainer"])
    assert len([k for k in expected if k[1] == "loss"]) == 8 and (4, "eval_loss") in expected
    ours = run_tool("run", "-q", script, "--", *TRAINER_ARGS, cwd=tmp_path / "tpu", timeout=600)
    assert ours.returncode == 0, ours.stderr[-3000:]
    assert device(ours.stdout) == "tpu"
    _compare(expected, logged(ours.stdout), expected)
    # Resume from checkpoint-4, as after a crash: steps 5-8 again, from the saved weights, optimizer and data order,
    # under the profiler (fused mode): the same losses, and the profile's device figures.
    out = tmp_path / "tpu" / "hf_trainer_out"
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-4", "checkpoint-8"]
    shutil.rmtree(out / "checkpoint-8")
    again = _profiled(script, [*TRAINER_ARGS, "--resume"], tmp_path / "tpu")
    _compare(expected, logged(again.stdout), [(s, "loss") for s in range(5, 9)] + [(8, "eval_loss")])

    # accelerate_loop.py
    script = str(EXAMPLES / "accelerate_loop.py")
    assert device(cpu["accelerate"]) == "cpu"
    expected = logged(cpu["accelerate"])
    assert len(expected) == 9  # 8 steps and the gathered eval loss
    ours = run_tool("run", "-q", script, "--", "--steps", "8", cwd=tmp_path / "tpu", timeout=600)
    assert ours.returncode == 0, ours.stderr[-3000:]
    assert device(ours.stdout) == "tpu" and "warning" not in ours.stderr
    _compare(expected, logged(ours.stdout), expected)
    # load_state of what save_state wrote at step 4: steps 5-8 and the eval as the uninterrupted run, under the
    # profiler (fused mode), with the profile's device figures.
    assert (tmp_path / "tpu" / "accelerate_out" / "state" / "model.safetensors").is_file()
    again = _profiled(script, ["--steps", "8", "--resume"], tmp_path / "tpu")
    resumed = logged(again.stdout)
    assert sorted(resumed) == sorted(k for k in expected if k[0] > 4 or k[1] == "eval_loss")
    _compare(expected, resumed, resumed)

    # Llama and ViT under Trainer
    ours = run_tool("run", "-q", str(family_script), "--", *FAMILIES, cwd=tmp_path / "tpu", timeout=600)
    assert ours.returncode == 0, ours.stderr[-3000:]
    cpu_out, tpu_out = by_family(cpu["families"]), by_family(ours.stdout)
    assert sorted(cpu_out) == sorted(tpu_out) == sorted(FAMILIES), (cpu["families"], ours.stdout)
    for family in FAMILIES:
        expected = logged(cpu_out[family])
        assert device(cpu_out[family]) == "cpu" and len(expected) == 5, family  # 4 steps and the eval
        assert device(tpu_out[family]) == "tpu" and (tmp_path / "tpu" / f"out-{family}" / "checkpoint-4").is_dir()
        _compare(expected, logged(tpu_out[family]), expected)
