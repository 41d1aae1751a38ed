"""Every setting tpu-agent reads from the environment, declared once: its name, who reads it, its type, its
default and what it means; and the one cache-directory rule.

The bottom layer: this module imports the standard library only and `tpu_agent/__init__.py` does nothing, so
the device (`tpu_agent.backend`), the profiler (`tpu_agent.profilers`) and the application all read their
settings here, in the style of JAX's config: `PAD_OPS.get()` is the text as set (None when unset or empty),
`DEVICES.value` the typed value (`int`, its default when unset; a flag is a `bool`). Writers use the
declaration's name (`env[PLAN.name] = ...`). No other module reads a `TPU_AGENT_*` variable from
`os.environ` (or names one that is not declared here): tests/test_layering.py checks both.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Reader = Literal["backend", "child", "tool"]


@dataclass(frozen=True)
class EnvVar:
    """A variable read as text."""

    name: str
    reader: Reader  # backend: the device; child: the run's child process (set by the parent); tool: the CLI
    help: str

    def get(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The text as set; None when unset or empty."""
        return (os.environ if environ is None else environ).get(self.name) or None

    def pop(self, environ: MutableMapping[str, str] | None = None) -> str | None:
        """Read it once and remove it, so the user's script and its own children do not inherit it."""
        return (os.environ if environ is None else environ).pop(self.name, None)

    def read(self, environ: Mapping[str, str] | None = None):
        """The typed value (here the text, None when unset)."""
        return self.get(environ)

    @property
    def value(self):
        """The typed value in this process's environment, read now."""
        return self.read()


@dataclass(frozen=True)
class Flag(EnvVar):
    """On exactly when set to `1`."""

    def read(self, environ: Mapping[str, str] | None = None) -> bool:
        return self.get(environ) == "1"


@dataclass(frozen=True)
class Text(EnvVar):
    """Text with a default for when it is unset or empty."""

    default: str | None = None

    def read(self, environ: Mapping[str, str] | None = None) -> str | None:
        return self.get(environ) or self.default


@dataclass(frozen=True)
class Int(EnvVar):
    """An integer, its default when unset or empty; ValueError naming the variable when it is not one."""

    default: int | None = None
    minimum: int | None = None

    def read(self, environ: Mapping[str, str] | None = None) -> int | None:
        raw = self.get(environ)
        if raw is None:
            return self.default
        value = int(raw) if re.fullmatch(r"\s*-?[0-9]+\s*", raw) else None
        if value is None or (self.minimum is not None and value < self.minimum):
            wanted = "a positive integer" if self.minimum == 1 else (
                "an integer" if self.minimum is None else f"an integer >= {self.minimum}")
            raise ValueError(f"{self.name}={raw!r} must be {wanted}")
        return value


# --- the tool's own settings
CACHE_DIR = EnvVar("TPU_AGENT_CACHE_DIR", "tool",
                   "the cache directory (peak calibrations, XLA's compilation cache); default $XDG_CACHE_HOME/tpu-agent")
MEASURE_SLOTS = Int("TPU_AGENT_MEASURE_SLOTS", "tool",
                    "measurements timed at once on this host (tpu_agent.measure.slots); default one per two cores",
                    minimum=1)
ANTHROPIC_API_KEY = EnvVar("ANTHROPIC_API_KEY", "tool",
                           "the Claude proposer's key; `--proposer auto` means claude exactly when it is set")

# --- parent -> child: what a run's child process is asked to do (run.messages has their payloads)
RUN_DIR = EnvVar("TPU_AGENT_RUN_DIR", "child", "the run directory the child (and its hooks) write into")
PROFILE = EnvVar("TPU_AGENT_PROFILE", "child", "profile this run: the profiler's Settings as JSON")
PROGRESS_FD = EnvVar("TPU_AGENT_PROGRESS_FD", "child", "a pipe the parent reads the profiler's progress from")
TRIAL = EnvVar("TPU_AGENT_TRIAL", "child", "a timing trial: run.messages.TrialRequest as JSON (plan, gate and report pipes)")
PLAN = EnvVar("TPU_AGENT_PLAN", "child", "`tpu-agent run --plan`: the plan whose run-time actions the child applies")
DEVICE_MAP = EnvVar("TPU_AGENT_DEVICE_MAP", "child",
                    "`--device-map cuda=tpu`: the script's CUDA calls run on tpu (run.device_map)")
ONE_RANK = Flag("TPU_AGENT_ONE_RANK", "tool",
                "`1` (tune --nproc 1): every one-process child the tool launches gets torchrun's variables for a "
                "group of one, each with a MASTER_PORT of its own (run.launch)")

# --- the device's flags (read by backend/)
DEVICE = EnvVar("TPU_AGENT_DEVICE", "backend", "`bundled`: ours even beside Google's torch_tpu; `off`: not registered")
DEVICES = Int("TPU_AGENT_DEVICES", "backend", "N simulated devices on a CPU host", minimum=1)
GENERATION = Text("TPU_AGENT_GENERATION", "backend",
                  "the TPU generation the device reports (v4, v5e, v5p, v6e, v7x)", default="v5e")
CPU_FALLBACK = Flag("TPU_AGENT_CPU_FALLBACK", "backend", "`1`: ops without a lowering run on the CPU, counted")
PAD_OPS = EnvVar("TPU_AGENT_PAD_OPS", "backend",
                 "zero-pad matmul/convolution operand dims to this multiple (`MULTIPLE` or `MULTIPLE:SIZE,SIZE`)")
TIME_EXECUTABLES = Flag("TPU_AGENT_TIME_EXECUTABLES", "backend",
                        "`1`: wait for every executable so its time is execution time")
MAX_GRAPH_OPS = Int("TPU_AGENT_MAX_GRAPH_OPS", "backend",
                    "fused mode: run the pending graph when it holds this many ops", default=10_000)
COMPILE_STEPS = Flag("TPU_AGENT_COMPILE_STEPS", "backend",
                     "`1`: the model's forward and backward and each optimizer's update run as compiled programs")
XLA_CACHE = EnvVar("TPU_AGENT_XLA_CACHE", "backend",
                   "XLA's persistent compilation cache: a directory, or `off`; default xla/ in the cache directory")
COLLECTIVES_IN_PROGRAM = Text("TPU_AGENT_COLLECTIVES_IN_PROGRAM", "backend",
                              "`0`: in fused mode a collective runs between programs (a sync point), not inside "
                              "the fused graph as one SPMD program over the ranks", default="1")
DEFER_AND_FUSE = Flag("TORCH_TPU_DEFER_AND_FUSE", "backend",
                      "`1`: start in fused mode (Google TorchTPU's variable, honoured by the bundled device)")

ALL: tuple[EnvVar, ...] = (CACHE_DIR, MEASURE_SLOTS, ANTHROPIC_API_KEY, RUN_DIR, PROFILE, PROGRESS_FD, TRIAL, PLAN,
                           DEVICE_MAP, ONE_RANK, DEVICE, DEVICES, GENERATION, CPU_FALLBACK, PAD_OPS, TIME_EXECUTABLES, MAX_GRAPH_OPS,
                           COMPILE_STEPS, XLA_CACHE, COLLECTIVES_IN_PROGRAM, DEFER_AND_FUSE)
NAMES = frozenset(v.name for v in ALL)


def cache_dir() -> Path:
    """`$TPU_AGENT_CACHE_DIR`, else `$XDG_CACHE_HOME/tpu-agent`, else `~/.cache/tpu-agent`: the one rule, for
    the profiler's peak calibrations, the device's XLA cache and the doctor's report."""
    override = CACHE_DIR.get()
    if override:
        return Path(override).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "tpu-agent"
