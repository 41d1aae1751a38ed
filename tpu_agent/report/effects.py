"""What a verified plan does to the model, one line per action, for the console and report.md: the class of the
change (exact, numerics, model, training) and what it means for the user's training, with measured figures."""

from __future__ import annotations

from tpu_agent.plan.action_base import EFFECT_TEXT
from tpu_agent.plan.actions import Compile, MatmulPrecision, PadDim, Plan


def effect_line(action, parameters: list[int | None]) -> str:
    text = f"{action.effect} ({EFFECT_TEXT[action.effect]}): {action.describe()}"
    if isinstance(action, PadDim) and action.effect == "model":
        before, after = parameters if len(parameters) == 2 else (None, None)
        counted = (f"parameters {before:,} -> {after:,} ({after - before:+,}, measured)"
                   if before is not None and after is not None else "parameters before and after not measured")
        vocab = "vocab" in (action.name or "").lower() or "token" in (action.name or "").lower()
        rows = (f"; the {action.new - action.old} added vocabulary rows never appear in the data, so they are "
                "never labels (their logits still enter the softmax, so the loss differs slightly)" if vocab else "")
        return (f"{text}; {counted}{rows}; the literal shapes no data tensor (the knob finder's reading), "
                "so the data is unchanged")
    if isinstance(action, PadDim) and action.effect == "training":
        unit = "per sample" if action.batch else "per step"
        return f"{text}; time is compared {unit}"
    if isinstance(action, MatmulPrecision) and action.effect == "numerics":
        return f"{text}; the losses were held to the loss tolerance (--loss-tol), not to the baseline's"
    if isinstance(action, Compile) and action.mode == "compiled":
        return (f"{text}; the step runs as XLA programs whose backward XLA derives from the forward, the same "
                "math in another order (about 2e-7 relative in the loss over 20 AdamW steps of an unaligned Llama); "
                "the losses were held to the loss tolerance (--loss-tol), not to the baseline's")
    if isinstance(action, Compile) and action.mode == "fused":
        return (f"{text}; the ops run as one XLA program per step, which fuses what eager ran op by op: the same "
                "math in another order (2.01e-05 relative in examples/odd_shapes.py's loss, at step 16 of 22); the "
                "losses were held to the loss tolerance (--loss-tol), not to the baseline's")
    note = action.effect_note()
    return f"{text}; {note}" if note else text


def effect_lines(plan: Plan, parameters: list[int | None], trials=()) -> list[str]:
    """`trials`: the search's records. An exact change whose losses left the baseline's in a trial of exact
    changes only says so: its class names what the change is, the trial what
    was measured, and a plan with a numerics part held it to the loss tolerance only."""
    lines = []
    for action in plan.actions:
        line = effect_line(action, parameters)
        failed = _failed_exact(action, trials) if action.effect == "exact" else None
        if failed is not None:
            held = ("the losses of this plan were held to the loss tolerance (--loss-tol)"
                    if not plan.preserves_numerics else "this plan's losses matched the baseline's")
            line += (f"; but measured, trial {failed.number} ({failed.plan.describe()}, exact changes only) "
                     f"failed the exact check: {failed.reason}; {held}")
        lines.append(line)
    return lines


def _failed_exact(action, trials):
    """The first trial whose plan held only exact changes, this one among them, and whose losses were off."""
    for trial in trials:
        actions = trial.plan.actions
        if (trial.state == "numerics" and action in actions and all(a.effect == "exact" for a in actions)):
            return trial
    return None
