"""What a verified plan does to the model, one line per action, for the console and report.md: the class of the
change (exact, numerics, model, training) and what it means for the user's training, with measured figures."""

from __future__ import annotations

from tpu_agent.plan.actions import EFFECT_TEXT, Compile, MatmulPrecision, PadDim, Plan


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
    if isinstance(action, Compile) and action.effect == "numerics":
        return (f"{text}; the step runs as XLA programs whose backward XLA derives from the forward, the same "
                "math in another order (about 2e-7 relative in the loss over 20 AdamW steps of an unaligned Llama); "
                "the losses were held to the loss tolerance (--loss-tol), not to the baseline's")
    note = action.effect_note()
    return f"{text}; {note}" if note else text


def effect_lines(plan: Plan, parameters: list[int | None]) -> list[str]:
    return [effect_line(a, parameters) for a in plan.actions]
