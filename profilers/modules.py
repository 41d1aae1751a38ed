"""The modules the script built, with their constructor sizes: what a knob's value sizes at run time.

A global forward pre-hook sees each model the first time it is called with
its parameters on tpu, walks it once (`named_modules`) and records the size
attributes of its modules (an Embedding's num_embeddings and embedding_dim,
a Linear's in/out_features, a conv's channels, a norm's shape, a script's
own `n_head`...), identical sizes grouped. The hook goes at the first step
boundary after a model was seen (the second at the latest), so the measured
steps pay nothing; before that, a module call costs a set lookup (to the
end in a run without step markers, which is one region anyway). Sizes are
read from the built modules' attributes, not from the source: the value the
run uses, whatever config carried it there.
"""

from __future__ import annotations

SIZE_ATTRS = (
    "num_embeddings", "embedding_dim", "in_features", "out_features", "in1_features", "in2_features",
    "in_channels", "out_channels", "normalized_shape", "num_features", "num_groups", "num_channels",
    "embed_dim", "num_heads", "head_dim", "kdim", "vdim", "input_size", "hidden_size", "proj_size",
    "d_model", "nhead", "n_head", "n_embd", "nf", "nx", "num_attention_heads", "intermediate_size", "vocab_size",
)
MAX_GROUPS = 200
MAX_PATHS = 3
WRAPPER_PREFIXES = ("_orig_mod.", "module.")  # torch.compile's OptimizedModule, DataParallel/DDP


def _size(value):
    """An int size, or a shape (tuple of ints) as a tuple; None for anything else (bools included)."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    if isinstance(value, (tuple, list)) and value and all(type(v) is int for v in value):
        return tuple(value)
    return None


def sizes_of(module) -> tuple[tuple[str, object], ...]:
    """The module's size attributes, in SIZE_ATTRS order (read from its __dict__: no __getattr__ lookups)."""
    own = module.__dict__
    return tuple((name, size) for name in SIZE_ATTRS if name in own and (size := _size(own[name])) is not None)


ROUTER_NAMES = ("gate", "router", "w_gate")  # the router Linear of a Mixtral-style block, by its usual names
TOP_K_NAMES = ("top_k", "num_experts_per_tok")


def moe_parts(module):
    """(router, experts, top_k) when `module` is a hand-written MoE block (a ModuleList `experts` of 2 or more, a
    router Linear with one output per expert, an int top-k attribute, not transformers' experts interface),
    else None."""
    import torch.nn as nn

    subs, own = module.__dict__.get("_modules", {}), module.__dict__
    experts = subs.get("experts")
    if not isinstance(experts, nn.ModuleList) or len(experts) < 2 or "has_gate" in own:
        return None
    router = next((subs[n] for n in ROUTER_NAMES if isinstance(subs.get(n), nn.Linear)), None)
    top_k = next((own[n] for n in TOP_K_NAMES if type(own.get(n)) is int), None)
    if router is None or router.out_features != len(experts) or top_k is None or not 1 <= top_k <= len(experts):
        return None
    return router, experts, top_k


def _path(name: str) -> str:
    for prefix in WRAPPER_PREFIXES:
        while name.startswith(prefix):
            name = name[len(prefix):]
    return name or "(the model)"


class ModuleWatch:
    """Records the sizes of the modules in each model the script calls on tpu, once per model."""

    def __init__(self) -> None:
        self.models: list[str] = []
        self.groups: dict[tuple[str, tuple], list] = {}  # (class, sizes) -> [count, paths]
        self.experts: dict[tuple[str, str, int], list] = {}  # (class, implementation, experts) -> [count, paths]
        self.boundaries = 0
        self._seen: set[int] = set()
        self._hook = None
        self._remove_listener = None

    def install(self) -> None:
        import torch

        from tpu_agent.backend.core import steps

        self._hook = torch.nn.modules.module.register_module_forward_pre_hook(self._on_call)
        self._remove_listener = steps.add_step_listener(self._on_step)

    def uninstall(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._remove_listener is not None:
            self._remove_listener()
            self._remove_listener = None

    def _on_step(self, _source: str) -> None:
        self.boundaries += 1
        if self.models or self.boundaries >= 2:
            self.uninstall()

    def _on_call(self, module, _args):
        if id(module) in self._seen:
            return None
        try:
            param = next(module.parameters(), None)
            if param is not None and param.device.type == "tpu":
                self.record(module)
        except Exception:  # noqa: BLE001 - a record we cannot make must never break the script
            pass
        return None

    def record(self, model) -> None:
        """Walk `model` once: every module with a size attribute, grouped by class and sizes."""
        self.models.append(type(getattr(model, "_orig_mod", model)).__name__)
        for name, module in model.named_modules():
            self._seen.add(id(module))
            self._record_experts(name, module)
            sizes = sizes_of(module)
            if not sizes:
                continue
            group = self.groups.setdefault((type(module).__name__, sizes), [0, []])
            group[0] += 1
            if len(group[1]) < MAX_PATHS:
                group[1].append(_path(name))

    def _record_experts(self, name: str, module) -> None:
        """A Hugging Face MoE experts module (transformers' `use_experts_implementation` sets `has_gate` on it),
        with the implementation its config runs: "eager" is a loop over the experts hit, data-dependent; or a
        hand-written MoE block (`moe_parts`), "loop": the script's own code over its experts list."""
        own = module.__dict__
        implementation = getattr(own.get("config"), "_experts_implementation", None)
        parts = moe_parts(module)
        if parts is not None:
            key = (type(module).__name__, "loop", len(parts[1]))
        elif "has_gate" not in own or not isinstance(implementation, str):
            return
        else:
            experts = own.get("num_experts")
            key = (type(module).__name__, implementation, experts if isinstance(experts, int) else 0)
        group = self.experts.setdefault(key, [0, []])
        group[0] += 1
        if len(group[1]) < MAX_PATHS:
            group[1].append(_path(name))

    def report(self):
        """The BuiltModules for profile.json; None when no model was called on tpu."""
        from .schema import BuiltModules, ExpertsModules, ModuleSize

        if not self.models:
            return None
        groups = list(self.groups.items())
        sizes = [ModuleSize(kind=kind, sizes={k: list(v) if isinstance(v, tuple) else v for k, v in attrs},
                            count=count, paths=paths)
                 for (kind, attrs), (count, paths) in groups[:MAX_GROUPS]]
        experts = [ExpertsModules(kind=kind, implementation=impl, experts=n, count=count, paths=paths)
                   for (kind, impl, n), (count, paths) in self.experts.items()]
        return BuiltModules(models=self.models, sizes=sizes, left_out=max(0, len(groups) - MAX_GROUPS),
                            experts=experts)
