"""Changes that change nothing: found before anything is measured, said in one line, never measured, verified or
kept.

A change is a no-op when the run it makes is the baseline's run: the same source, the same effective run-time
settings, so the same compiled programs. Measuring one can only report noise (an A/A comparison), and keeping
one on a lucky draw would credit the tool with a gain it did not make. What is checked, against the baseline's
profile (what the unchanged script ran):

- matmul precision: the precision the baseline's device already runs (DEFAULT, the device's own, unless the
  script sets one itself); any precision on a CPU host, whose XLA backend compiles the same f32 kernel at every
  precision (its effect is a TPU's: never verified here);
- operand padding (`pad_ops`): a multiple that every matmul and convolution dim it would pad already has (or, for
  targeted sizes, sizes that are already multiples of it, or that no op of the step has);
- execution mode: the mode the baseline already ran in;
- a source literal rewritten to the value it already has.

Everything here reads a plan and a profile; nothing runs.
"""

from __future__ import annotations

from pathlib import Path

from tpu_agent.plan.actions import Compile, MatmulPrecision, PadDim, PadOps, Plan

# The module size attributes operand padding pads (matmul rows/columns, convolution channels, embedding widths).
_PADDED_SIZES = ("in_features", "out_features", "in_channels", "out_channels", "embedding_dim")


def _script_sets_precision(profile) -> bool:
    """The script sets a matmul precision itself (its baseline's precision is then not known to be DEFAULT)."""
    try:
        text = Path(profile.script).read_text(encoding="utf-8", errors="replace")
    except (OSError, TypeError, AttributeError):
        return True  # unknown: assume it may
    return "Precision" in text or "set_float32_matmul_precision" in text


def padded_dims(profile) -> set[int] | None:
    """The dims operand padding would pad in the baseline's step: M, K and N of every dot and convolution the
    profile recorded, and the feature and channel sizes of the modules built. None when the profile recorded no
    op (nothing is known: no padding is called a no-op then)."""
    dims: set[int] = set()
    padding = getattr(profile, "padding", None)
    for op in (padding.ops if padding is not None else []):
        dims.update((op.m, op.k, op.n))
    modules = getattr(profile, "modules", None)
    for size in (modules.sizes if modules is not None else []):
        for name in _PADDED_SIZES:
            value = size.sizes.get(name)
            if isinstance(value, int):
                dims.add(value)
    return dims or None


def no_change(action, profile) -> str | None:
    """Why `action` changes nothing in the baseline's run (one line), or None when it changes something or that
    cannot be told from the profile."""
    if profile is None:
        return None
    if isinstance(action, MatmulPrecision):
        if action.precision == "default" and not _script_sets_precision(profile):
            return "matmul precision default is the precision the device already runs"
        device = getattr(profile, "device", None)
        if getattr(device, "platform", None) == "cpu":
            # XLA's CPU backend compiles the same f32 matmul kernel at every precision (only the dot's
            # operand_precision attribute differs; results bit-identical): a TPU's gain, estimated, never verified
            return (f"matmul precision {action.precision}: this host (JAX platform cpu) runs f32 matmuls the same at "
                    "every precision; what it changes is a TPU's (an estimate, never verified here)")
    elif isinstance(action, PadOps):
        dims = padded_dims(profile)
        if dims is None:
            return None
        targets = dims & set(action.sizes) if action.sizes else dims
        if not targets:
            return f"no matmul or convolution dim of the step has a size in {list(action.sizes)}"
        if all(d % action.multiple == 0 for d in targets):
            which = f"dims of size {', '.join(map(str, sorted(targets)))}" if action.sizes else "dim"
            return f"every matmul and convolution {which} is already a multiple of {action.multiple}"
    elif isinstance(action, Compile):
        settings = getattr(profile, "settings", None)  # the profiler left the script's mode alone (tune's baseline)
        if getattr(settings, "mode", None) == "eager" and action.mode == getattr(profile, "mode_used", None):
            return f"the baseline already runs in {action.mode} mode"
    elif isinstance(action, PadDim):
        if action.old == action.new:
            return f"{action.describe()} leaves the source as it is"
    return None


def effective(plan: Plan, profile) -> tuple[Plan, list[str]]:
    """The plan without its no-op actions, and one line for each left out (`pad_ops {...}: no change: why`)."""
    kept, said = [], []
    for action in plan.actions:
        why = no_change(action, profile)
        if why is None:
            kept.append(action)
        else:
            said.append(f"no change: {action.describe()}: {why}")
    return Plan(actions=kept), said
