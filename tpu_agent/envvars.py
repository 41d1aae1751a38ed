"""Every `TPU_AGENT_*` environment variable, declared once: its name, who reads it, what it means.

Code reads and writes them through these declarations (`RUN_DIR.get()`,
`env[PLAN.name] = ...`), never through a string literal of its own. The
backend and the profiler read theirs without importing this module (they sit
below the application); a test checks that every
`TPU_AGENT_*` name in the source is declared here (tests/test_layering.py).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Literal

Reader = Literal["backend", "child", "tool"]


@dataclass(frozen=True)
class EnvVar:
    name: str
    reader: Reader  # backend: the device; child: the run's child process (set by the parent); tool: the CLI
    help: str

    def get(self, environ: Mapping[str, str] | None = None) -> str | None:
        return (os.environ if environ is None else environ).get(self.name) or None

    def pop(self, environ: MutableMapping[str, str] | None = None) -> str | None:
        """Read it once and remove it, so the user's script and its own children do not inherit it."""
        return (os.environ if environ is None else environ).pop(self.name, None)


# --- the tool's own settings
CACHE_DIR = EnvVar("TPU_AGENT_CACHE_DIR", "tool", "the cache directory (peak calibrations); default $XDG_CACHE_HOME/tpu-agent")

# --- parent -> child: what a run's child process is asked to do (run.messages has their payloads)
RUN_DIR = EnvVar("TPU_AGENT_RUN_DIR", "child", "the run directory the child (and its hooks) write into")
PROFILE = EnvVar("TPU_AGENT_PROFILE", "child", "profile this run: the profiler's Settings as JSON")
PROGRESS_FD = EnvVar("TPU_AGENT_PROGRESS_FD", "child", "a pipe the parent reads the profiler's progress from")
TRIAL = EnvVar("TPU_AGENT_TRIAL", "child", "a timing trial: run.messages.TrialRequest as JSON (plan, gate and report pipes)")
PLAN = EnvVar("TPU_AGENT_PLAN", "child", "`tpu-agent run --plan`: the plan whose run-time actions the child applies")
DEVICE_MAP = EnvVar("TPU_AGENT_DEVICE_MAP", "child",
                    "`--device-map cuda=tpu`: the script's CUDA calls run on tpu (run.device_map)")

# --- the device (read by backend/, which does not import this module)
DEVICE = EnvVar("TPU_AGENT_DEVICE", "backend", "`bundled`: ours even beside Google's torch_tpu; `off`: not registered")
DEVICES = EnvVar("TPU_AGENT_DEVICES", "backend", "N simulated devices on a CPU host")
GENERATION = EnvVar("TPU_AGENT_GENERATION", "backend", "the TPU generation the device reports (v4, v5e, v5p, v6e, v7x)")
CPU_FALLBACK = EnvVar("TPU_AGENT_CPU_FALLBACK", "backend", "`1`: ops without a lowering run on the CPU, counted")
PAD_OPS = EnvVar("TPU_AGENT_PAD_OPS", "backend", "zero-pad matmul/convolution operand dims to this multiple")
TIME_EXECUTABLES = EnvVar("TPU_AGENT_TIME_EXECUTABLES", "backend", "`1`: wait for every executable so its time is execution time")
MAX_GRAPH_OPS = EnvVar("TPU_AGENT_MAX_GRAPH_OPS", "backend",
                       "fused mode: run the pending graph when it holds this many ops (default 10000)")
COMPILE_STEPS = EnvVar("TPU_AGENT_COMPILE_STEPS", "backend",
                       "`1`: the model's forward and backward and each optimizer's update run as compiled programs")
XLA_CACHE = EnvVar("TPU_AGENT_XLA_CACHE", "backend",
                   "XLA's persistent compilation cache: a directory, or `off`; default xla/ in the cache directory")

ALL: tuple[EnvVar, ...] = (CACHE_DIR, RUN_DIR, PROFILE, PROGRESS_FD, TRIAL, PLAN, DEVICE_MAP, DEVICE, DEVICES, GENERATION,
                           CPU_FALLBACK, PAD_OPS, TIME_EXECUTABLES, MAX_GRAPH_OPS, COMPILE_STEPS, XLA_CACHE)
NAMES = frozenset(v.name for v in ALL)
