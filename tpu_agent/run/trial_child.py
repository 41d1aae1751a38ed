"""The child side of a timing trial: apply the plan, then run the script one step at a time.

The parent holds a gate: at every step boundary the child synchronizes the
device, reports the step (wall time, loss, device bytes) on a pipe and waits
for the next go. Two warm processes, baseline and candidate, can so be timed
step by step in alternation (A B A B ...), each step measured while the
other process is idle, which keeps a shared machine's noise out of the ratio.

The loss of a step is the scalar `backward()` was called on, so scripts need
no change.
"""

from __future__ import annotations

import json
import os
import time

import torch


class StopTrial(BaseException):
    """Raised at a step boundary when the parent has what it needs."""


class TrialSession:
    def __init__(self, spec: dict):
        from tpu_agent.plan.actions import Plan

        self.plan = Plan.model_validate(spec["plan"])
        self.gate = os.fdopen(spec["gate_fd"], "rb", buffering=0)
        self.report = os.fdopen(spec["report_fd"], "w", buffering=1)
        self.step = 0
        self.last = None
        self.loss = None
        self.applied = None

    @classmethod
    def from_env(cls) -> "TrialSession | None":
        raw = os.environ.pop("TPU_AGENT_TRIAL", None)
        return cls(json.loads(raw)) if raw else None

    def start(self) -> None:
        from tpu_agent.plan.runtime import apply_runtime
        from tpu_agent.backend.steps import add_step_listener

        self.applied = apply_runtime(self.plan)
        self._patch_backward()
        add_step_listener(self._on_step)
        self._send({"event": "ready", "notes": self.applied.notes})
        self._wait_for_go()
        self.last = time.perf_counter()

    def _patch_backward(self) -> None:
        session = self
        original = torch.Tensor.backward

        def backward(tensor, *args, **kwargs):
            if tensor.numel() == 1:
                session.loss = tensor.detach()
            return original(tensor, *args, **kwargs)

        torch.Tensor.backward = backward

    def _on_step(self, source: str) -> None:
        torch.tpu.synchronize()
        now = time.perf_counter()
        self.step += 1
        loss = float(self.loss.item()) if self.loss is not None else None
        record = {"event": "step", "step": self.step, "wall_s": now - self.last, "loss": loss,
                  "device_bytes": _device_bytes()}
        if self.step == 1 and self.applied is not None:
            record["model"] = self.applied.model
            record["sharded"] = self.applied.sharded
        self._send(record)
        self._wait_for_go()
        self.last = time.perf_counter()

    def _send(self, record: dict) -> None:
        self.report.write(json.dumps(record) + "\n")

    def _wait_for_go(self) -> None:
        byte = self.gate.read(1)
        if byte != b"g":  # b"q", or the parent went away
            raise StopTrial()

    def finish(self, status: int, error: str | None) -> None:
        try:
            self._send({"event": "end", "status": status, "error": error, "steps": self.step})
        except (BrokenPipeError, ValueError):
            pass


def _device_bytes() -> int:
    """Most bytes of live device arrays on any one device (sharding's saving is per device)."""
    from tpu_agent.backend.sharding import bytes_per_device

    per_device = bytes_per_device()
    return max(per_device.values()) if per_device else 0
