"""Whether a run put any work on the `tpu` device, and what the user is told when it did not.

A script that picks "cuda" when it is available, or never moves its model, trains on the CPU under the
tool and would otherwise be reported as if measured on the device ("0 FLOP", "MFU 0.0 %"). `run` warns at
the end; `profile`, `knobs` and `tune` refuse to show device figures for such a profile. A script that
insists on CUDA fails with PyTorch's own error; the line after its traceback names the switch.
"""

from __future__ import annotations

HINT = ('pass --device-map cuda=tpu if the script picks "cuda" when it is available, '
        'or move the model and its batches with .to("tpu")')


def trained_off_the_device() -> bool:
    """In the run's child: did a torch optimizer step while no op or copy ever reached our device?

    An optimizer step is what makes it a model that trained (a script that only prints, or fails before
    training, is left alone); False too when our device is not the one loaded (off, or Google's torch_tpu:
    its work is not counted here)."""
    import torch

    from tpu_agent.backend.integration import module
    from tpu_agent.backend.core import steps
    from tpu_agent.backend.core.state import STATS

    if getattr(torch, "tpu", None) is not module:
        return False
    return bool(steps.trained) and STATS.ops == 0 and STATS.h2d_count == 0


def profile_touched(profile) -> bool:
    """Did the profiled run put work on the device? Told by the ops dispatched to it (the device's own counter),
    not by training steps or by the programs that ran: a script that moves two tensors to tpu and multiplies them,
    with no optimizer and no value read back, used the device even though fused execution never ran a program.
    A profile written before the counter existed: an executable ran, or it counted device FLOPs."""
    if getattr(profile, "device_ops", None):
        return True
    transfers = getattr(profile, "transfers", None)
    if transfers is not None and transfers.h2d_count > 0:
        return True
    flops = profile.flops.per_step if profile.flops is not None else 0.0
    return any(e.calls > 0 for e in profile.executables) or flops > 0


NO_CUDA = ("Torch not compiled with CUDA enabled", "Found no NVIDIA driver", "No CUDA GPUs are available")


def cuda_hint(exc: BaseException) -> str | None:
    """After a script's own traceback: the line that says a script written for CUDA runs here with the map."""
    if any(text in str(exc) for text in NO_CUDA):
        return "tpu-agent: the script asks for CUDA: run it on tpu unedited with --device-map cuda=tpu"
    return None


def run_warning() -> str:
    return f"tpu-agent: warning: the model trained on the CPU: no op of this run ran on the tpu device; {HINT}"


def refusal(script: str, what: str) -> str:
    """The one line `profile` / `tune` / `knobs` print instead of device figures."""
    return f"no op of {script} ran on the tpu device, so there are no device figures to {what}; {HINT}"
