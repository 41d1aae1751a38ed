"""Switches a Hugging Face MoE model's experts to a static-shape implementation: the `experts_implementation`
action at run time.

The script builds its model; a global forward pre-hook meets each model at its first call and, when its
config runs the experts as the Python loop (`"eager"`), asks the model itself to switch
(`PreTrainedModel.set_experts_implementation`), the API a user would call. Models that cannot switch are
left as they are and said so in the trial's notes.
"""

from __future__ import annotations

from tpu_agent.plan.model_hook import until_first_model


def loops_over_experts(config) -> bool:
    """Whether a (sub)config runs its experts as the loop over the experts hit."""
    return getattr(config, "_experts_implementation", None) == "eager"


def use_experts_implementation(implementation: str, applied):
    """Installs the hook until the step boundary after the first model (the second boundary at the latest),
    so measured steps pay nothing; returns a function that removes it early."""
    seen: set[int] = set()

    def switch(module) -> bool:
        if id(module) in seen:
            return False
        seen.add(id(module))
        if not hasattr(module, "set_experts_implementation"):
            return False
        seen.update(id(m) for m in module.modules())  # its submodels are switched with it
        if not loops_over_experts(getattr(module, "config", None)):
            return True
        try:
            module.set_experts_implementation(implementation)
        except (ValueError, RuntimeError, ImportError) as exc:  # the model cannot switch: it runs as written
            applied.notes.append(f"{type(module).__name__} kept its experts loop: {str(exc).splitlines()[0][:160]}")
            return True
        applied.notes.append(f"{type(module).__name__}: MoE experts as {implementation} (was the expert loop)")
        return True

    return until_first_model(switch)
