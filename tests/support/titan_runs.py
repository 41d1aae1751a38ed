"""TorchTitan's own train entry point (torchtitan/train.py, its Llama 3 debug model) run on tpu under the tool:
one rank with torchrun's variables set by hand, or N ranks through `tpu-agent run --nproc N` (torchrun). Each
run's per-step losses are read from TorchTitan's log lines ("step:  1  loss:  8.15870", 5 decimals).

The config is TorchTitan's `llama3_debugmodel_varlen_attn`: the debug model (6 layers, dim 256, vocab 2048)
with its varlen attention backend, which the device lowers; the default config's FlexAttention compiles with
torch.compile's inductor, which has no tpu backend (docs/training-stacks.md). `partial_dtensor`: TorchTitan's
plain FSDP2 path (DTensor for model parallelism only); its default `spmd_types` path stops at fully_shard's
`dp_mesh_dims` check (see the note)."""

from __future__ import annotations

import re
import socket
import subprocess
from pathlib import Path

import torchtitan

from support.processes import clean_env, run_tool

TRAIN = Path(torchtitan.__file__).parent / "train.py"
CONFIG = ["--module", "llama3", "--config", "llama3_debugmodel_varlen_attn",
          "--parallelism.spmd-backend", "partial_dtensor", "--debug.seed", "0", "--metrics.log-freq", "1"]
NO_ACTIVATION_CHECKPOINT = "activation-checkpoint:none"  # tyro's subcommand; it goes last
# Under load a rank still compiling its first step's ops kept its partner in a collective past JAX's gloo timeout
# (once, load 17): not what is tested, so once more (the cache then holds those programs).
GLOO_READ_TIMEOUT = "Read timeout"
_LOSS = re.compile(r"step:\s+(\d+)\s.*?loss:\s+([-\d.]+)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(workdir: Path, args: list[str], *, nproc: int = 1, timeout: float = 900) -> subprocess.CompletedProcess:
    """TorchTitan's train.py with CONFIG + args in `workdir` (relative paths there); nothing downloaded."""
    env = clean_env(HF_HOME=str(workdir / "hf-home"), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    argv = [*CONFIG, *args, NO_ACTIVATION_CHECKPOINT]
    if nproc == 1:  # what torchrun --nproc-per-node 1 would set: TorchTitan reads LOCAL_RANK and starts a group
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        return run_tool("run", "-q", str(TRAIN), "--", *argv, cwd=workdir, env=env, timeout=timeout)
    for _ in range(2):
        proc = run_tool("run", "-q", "--nproc", str(nproc), str(TRAIN), "--", *argv, cwd=workdir, env=env,
                        timeout=timeout)
        if proc.returncode == 0 or GLOO_READ_TIMEOUT not in proc.stdout + proc.stderr:
            break
    return proc


def losses(proc: subprocess.CompletedProcess, rank_lines: int = 1) -> dict[int, float]:
    """Step -> loss from TorchTitan's log (every rank logs the same global loss; `rank_lines` of each step)."""
    found: dict[int, list[float]] = {}
    for step, loss in _LOSS.findall(re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr)):
        found.setdefault(int(step), []).append(float(loss))
    for step, values in found.items():
        assert len(values) == rank_lines and len(set(values)) == 1, f"step {step}: {values}"
    return {step: values[0] for step, values in sorted(found.items())}
