"""The child side of a timing trial: apply the plan, then run the script one step at a time.

The parent holds a gate: at every step boundary the child synchronizes the
device, reports the step (wall time, loss, its in-step peak of device bytes: backend/core/memory.py's
StepPeak) on a pipe and waits
for the next go. Two warm processes, baseline and candidate, can so be timed
step by step in alternation (A B A B ...), each step measured while the
other process is idle, which keeps a shared machine's noise out of the ratio.

The loss of a step is the scalar `backward()` was called on, so scripts need
no change. Every line on the pipe is a `run.messages` model.
"""

from __future__ import annotations

import os
import time

import torch
from pydantic import BaseModel

from tpu_agent.run.messages import Ended, Ready, StepRecord, TrialRequest, channel_paths


class StopTrial(BaseException):
    """Raised at a step boundary when the parent has what it needs."""


class TrialSession:
    def __init__(self, request: TrialRequest):
        self.plan = request.plan
        if request.channels is not None:  # one rank of a job: RANK, as the launcher set it
            gate, report = channel_paths(request.channels, int(os.environ.get("RANK", "0")))
            self.gate = open(gate, "rb", buffering=0)  # the parent holds both ends open: neither open blocks
            self.report = open(report, "w", buffering=1)
        else:
            self.gate = os.fdopen(request.gate_fd, "rb", buffering=0)
            self.report = os.fdopen(request.report_fd, "w", buffering=1)
        self.step = 0
        self.last = None
        self.loss = None
        self.compiled = False  # an XLA compile since the last step boundary
        self.calls_before: dict | None = None  # asked to fingerprint this step: each program's calls at its start

    def start(self) -> None:
        from tpu_agent.backend.core.steps import add_step_listener
        from tpu_agent.plan.runtime import apply_runtime

        import jax

        from tpu_agent.backend.core.memory import watch_step_peaks

        self.peaks = watch_step_peaks()
        applied = apply_runtime(self.plan)
        self._patch_backward()
        jax.monitoring.register_event_duration_secs_listener(self._on_jax_event)
        add_step_listener(self._on_step)
        self._send(Ready(notes=applied.notes))
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
        peak = max(_device_bytes(), self.peaks.end_step())  # after `now`: not in the step's time
        programs = None
        if self.calls_before is not None:
            from tpu_agent.run.programs import fingerprint

            programs, self.calls_before = fingerprint(self.calls_before), None
        self._send(StepRecord(step=self.step, wall_s=now - self.last, loss=loss, device_bytes=peak,
                              compiled=self.compiled, programs=programs))
        self._wait_for_go()
        self.compiled = False
        self.last = time.perf_counter()

    def _on_jax_event(self, event: str, duration: float, **_kw) -> None:
        if event.startswith("/jax/core/compile/"):
            self.compiled = True

    def _send(self, message: BaseModel) -> None:
        self.report.write(message.model_dump_json() + "\n")

    def _wait_for_go(self) -> None:
        byte = self.gate.read(1)
        if byte == b"p":  # go, and say which programs the step runs
            from tpu_agent.run.programs import calls

            self.calls_before = calls()
        elif byte != b"g":  # b"q", or the parent went away
            raise StopTrial()

    @staticmethod
    def is_stop(exc: BaseException) -> bool:
        return isinstance(exc, StopTrial)

    def finish(self, status: int, error: str | None) -> None:
        try:
            self._send(Ended(status=status, error=error, steps=self.step))
        except (BrokenPipeError, ValueError):
            pass


def _device_bytes() -> int:
    """Most bytes of live device arrays on any one device (sharding's saving is per device)."""
    from tpu_agent.backend.core.sharding import bytes_per_device

    per_device = bytes_per_device()
    return max(per_device.values()) if per_device else 0
