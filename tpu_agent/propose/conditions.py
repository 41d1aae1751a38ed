"""What playbooks test and compute from a profile: named metrics, `$variables`, field paths, conditions.

`Condition` is one test over the profile (`applies_when`): a dotted `field`
path of profile.json or a named `metric`, compared, or `any`/`all` of other
conditions; when it holds it returns the values as `Evidence`.
"""

from __future__ import annotations

import math
import re
import typing
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tpu_agent.profilers.schema import Profile
from tpu_agent.propose.candidates import Evidence
from tpu_agent.propose import buckets, parallel


# ------------------------------------------------------------------ metrics and variables


def _dot_ops(p: Profile):
    if p.padding and p.padding.ops:
        return [(op.lhs, op.flops_per_step) for op in p.padding.ops]
    return [(h.operands[0] if h.operands else h.shape, h.flops_per_step) for h in p.hot_ops
            if h.opcode in ("dot", "convolution") or h.contains]


def _f32_dot_share(p: Profile) -> float:
    ops = _dot_ops(p)
    total = sum(f for _, f in ops)
    return sum(f for shape, f in ops if shape.startswith("f32")) / total if total else 0.0


def _devices(p: Profile) -> int:
    return p.device.count if p.device else p.settings.devices


# name -> (what it means, how it is computed from a Profile)
METRICS: dict[str, tuple[str, Callable[[Profile], Any]]] = {
    "padding_waste": ("estimate: FLOP-weighted share of dot/conv TPU work that is tile padding (0 without a report)",
                      lambda p: p.padding.total_waste.value if p.padding else 0.0),
    "unaligned_dims": ("number of unaligned dim sizes in the padding report",
                       lambda p: len(p.padding.dims) if p.padding else 0),
    "dot_flop_share": ("dots' and convolutions' share of the step's FLOPs",
                       lambda p: p.flops.dot_conv_per_step / p.flops.per_step if p.flops and p.flops.per_step else 0.0),
    "f32_dot_share": ("share of dot/conv FLOPs with float32 operands", _f32_dot_share),
    "recompilations_after_warmup": ("recompilations in measured steps (after warm-up)",
                                    lambda p: sum(1 for r in p.recompilations
                                                  if r.step is not None and r.step > p.settings.warmup)),
    "recompiling_steps": ("measured steps that compiled again because shapes changed (0: shapes settle)",
                          lambda p: p.recompiling.compiling_steps if p.recompiling else 0),
    "bucketable_lengths": ("1 when the batches' changing length can be padded where they leave the loader (every "
                           "tensor with that length has a known pad value), else 0",
                           lambda p: 1 if buckets.pad_values(p) else 0),
    "experts_loops": ("Hugging Face MoE experts modules run as the loop over the experts hit (data-dependent "
                      "token counts per expert: a new program per count on XLA)",
                      lambda p: sum(e.count for e in p.modules.experts if e.implementation == "eager")
                      if p.modules else 0),
    "moe_loops": ("a script's own MoE blocks (a router, a list of experts) whose code loops over the experts, each "
                  "expert's tokens picked by the routing (data-dependent counts: a new program per count on XLA)",
                  lambda p: sum(e.count for e in p.modules.experts if e.implementation == "loop")
                  if p.modules else 0),
    "devices": ("devices the profile ran on (simulated ones included)", _devices),
    "executables_per_step": ("XLA executables run per measured step",
                             lambda p: sum(e.calls_per_step for e in p.executables)),
    "mode": ("the eager mode the device ran: eager, fused, compiled", lambda p: p.mode_used),
    "step_s": ("median measured step time, seconds", lambda p: p.steps.stats.median_s if p.steps.stats else 0.0),
    "compile_s": ("measured compile time over the run, seconds", lambda p: p.steps.compile_s),
    "mfu": ("achieved / peak FLOP/s", lambda p: (p.flops.mfu or 0.0) if p.flops else 0.0),
    "live_peak_bytes": ("most device buffer bytes alive at a step boundary",
                        lambda p: p.memory.live_peak_bytes or 0),
    "fallbacks": ("aten ops run on the CPU, counted", lambda p: sum(p.fallbacks.values())),
    "world_size": ("ranks of a torch.distributed run (profile --nproc); 1 otherwise", parallel.world_size),
    "fsdp": ("1 when the run is FSDP2: its ranks reduce-scattered gradients, or its source calls fully_shard",
             parallel.uses_fsdp),
    "mesh_2d": ("1 when the script builds a 2-D (dp, tp) mesh with init_device_mesh (read from its source)",
                parallel.builds_2d_mesh),
    "host_share": ("measured share of a steady step that is host overhead (Python, dispatch, tracing, recording "
                   "ops), from steps whose launches were waited for; 0 without that measurement",
                   lambda p: p.host_device.host_share if p.host_device else 0.0),
}

_MXU = {"v6e": 256, "v7x": 256, "v7": 256}

# $name -> (what it means, its value for a profile, a sample used to check templates at load)
VARIABLES: dict[str, tuple[str, Callable[[Profile], Any], Any]] = {
    "$mxu": ("MXU edge of the generation the padding report models (128; 256 on v6e/v7x)",
             lambda p: p.padding.mxu if p.padding else _MXU.get((p.device.generation or "") if p.device else "", 128), 128),
    "$devices": ("devices available", _devices, 2),
    "$sublanes": ("rows of a 32-bit TPU tile", lambda p: 8, 8),
    "$batch_multiple": ("8 rows per tile times the data-parallel degree", lambda p: 8 * max(1, _devices(p)), 16),
    "$length_dim": ("the batch dim whose length changes", lambda p: (buckets.main_dim(p).dim if buckets.main_dim(p)
                                                                    else 1), 1),
    "$length_pads": ("the batch tensors with that length, and their pad values",
                     buckets.pad_values, {"['input_ids']": 0.0, "['labels']": -100.0}),
    "$length_buckets": ("bucket lengths to try: one fixed length, the best 2 and 4 for the lengths seen (and a "
                        "max the script declares with mark_dynamic)",
                        buckets.bucket_choices, [(64,), (32, 64)]),
    "$length_pads_seen": ("whether the pad values were seen in the script's own batches (not assumed)",
                          buckets.pads_seen, True),
    "$mesh_shapes": ("[dp, tp] factorisations of the world size whose tp divides the blocks' Linear widths",
                     parallel.mesh_shapes, [(1, 2), (2, 1)]),
    "$dp_batches": ("whether the script's batches follow its rank or mesh coordinate (read from its source)",
                    parallel.dp_batches, True),
    # filled in per playbook from its own targets.dims (offline.py); a list of sizes
    "$dims": ("the sizes of the unaligned dims the playbook's targets.dims selects", lambda p: [], [1000]),
}


def variables(profile: Profile) -> dict[str, int]:
    return {name: fn(profile) for name, (_, fn, _) in VARIABLES.items()}


def _sample_variables() -> dict[str, int]:
    return {name: sample for name, (_, _, sample) in VARIABLES.items()}


# ------------------------------------------------------------------ profile field paths


def _model_in(annotation) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        for arg in typing.get_args(annotation):
            found = _model_in(arg)
            if found is not None:
                return found
    return None


def check_field_path(path: str) -> str | None:
    """Why `path` (dotted) names no field of `Profile`, or None when it does."""
    model: type[BaseModel] = Profile
    parts = path.split(".")
    for i, part in enumerate(parts):
        where = ".".join(parts[:i]) or "the profile"
        if part not in model.model_fields:
            known = ", ".join(sorted(model.model_fields))
            return f"{where} has no field {part!r} (fields: {known})"
        if i < len(parts) - 1:
            sub = _model_in(model.model_fields[part].annotation)
            if sub is None:
                return f"{'.'.join(parts[:i + 1])} has no sub-fields"
            model = sub
    return None


def resolve_field(profile: Profile, path: str):
    """The value at `path`; a list or dict stands for its number of items; None when absent."""
    value: Any = profile
    for part in path.split("."):
        if value is None:
            return None
        value = getattr(value, part, None)
    if isinstance(value, (list, dict)):
        return len(value)
    return value


# ------------------------------------------------------------------ schema


class Condition(BaseModel):
    """One test over the profile: a `field` path or a named `metric` compared, or `any`/`all` of others."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    field: str | None = Field(None, description="dotted path into profile.json, e.g. padding.total_waste.value")
    metric: str | None = Field(None, description="a named metric: " + ", ".join(METRICS))
    any: list["Condition"] | None = None
    all: list["Condition"] | None = None
    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    eq: str | float | bool | None = None
    ne: str | float | bool | None = None
    in_: list[str | float | bool] | None = Field(None, alias="in")
    exists: bool | None = None

    @model_validator(mode="after")
    def _shape(self):
        subjects = [k for k in ("field", "metric", "any", "all") if getattr(self, k) is not None]
        if len(subjects) != 1:
            raise ValueError("a condition has exactly one of field, metric, any, all")
        tests = [k for k in ("gt", "ge", "lt", "le", "eq", "ne", "in_", "exists") if getattr(self, k) is not None]
        if subjects[0] in ("any", "all"):
            if tests:
                raise ValueError(f"{subjects[0]} takes a list of conditions, not a comparison")
            if not getattr(self, subjects[0]):
                raise ValueError(f"{subjects[0]} needs at least one condition")
            return self
        if not tests:
            raise ValueError("a field or metric condition needs a comparison: gt, ge, lt, le, eq, ne, in or exists")
        if self.metric is not None:
            if self.metric not in METRICS:
                raise ValueError(f"unknown metric {self.metric!r} (known: {', '.join(METRICS)})")
            if self.exists is not None:
                raise ValueError("exists applies to fields, not metrics")
        if self.field is not None:
            problem = check_field_path(self.field)
            if problem:
                raise ValueError(f"field {self.field!r}: {problem}")
        return self

    def describe(self) -> str:
        if self.any:
            return "any of (" + "; ".join(c.describe() for c in self.any) + ")"
        if self.all:
            return "all of (" + "; ".join(c.describe() for c in self.all) + ")"
        ops = {"gt": ">", "ge": ">=", "lt": "<", "le": "<=", "eq": "==", "ne": "!=", "in_": "in", "exists": "exists"}
        subject = self.field or self.metric
        return " and ".join(f"{subject} {sym} {getattr(self, k)}" for k, sym in ops.items() if getattr(self, k) is not None)

    def evaluate(self, profile: Profile) -> tuple[bool, list[Evidence]]:
        """Whether it holds, and the values that made it hold (evidence for the candidate)."""
        if self.any is not None:
            for c in self.any:
                ok, ev = c.evaluate(profile)
                if ok:
                    return True, ev
            return False, []
        if self.all is not None:
            found: list[Evidence] = []
            for c in self.all:
                ok, ev = c.evaluate(profile)
                if not ok:
                    return False, []
                found += ev
            return True, found
        value = resolve_field(profile, self.field) if self.field else METRICS[self.metric][1](profile)
        if self.exists is not None and (value is not None) != self.exists:
            return False, []
        for key, test in (("gt", float.__gt__), ("ge", float.__ge__), ("lt", float.__lt__), ("le", float.__le__)):
            bound = getattr(self, key)
            if bound is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not test(float(value), bound):
                return False, []
        if self.eq is not None and not _same(value, self.eq):
            return False, []
        if self.ne is not None and _same(value, self.ne):
            return False, []
        if self.in_ is not None and not any(_same(value, v) for v in self.in_):
            return False, []
        subject = self.field or self.metric
        shown = round(value, 6) if isinstance(value, float) else value
        return True, [Evidence(what=f"{subject} = {shown} ({self.describe()})", metric=subject,
                               value=shown if isinstance(shown, (int, float, str)) else str(shown),
                               estimate=subject in ("padding_waste",) or (self.field or "").startswith(("padding", "target")))]


def _same(value, expected) -> bool:
    if isinstance(expected, (int, float)) and not isinstance(expected, bool) and isinstance(value, (int, float)):
        return math.isclose(float(value), float(expected))
    return value == expected or str(value) == str(expected)


def name_words(name: str) -> list[str]:
    """`NUM_CLASSES` -> num, classes; `nHeads` -> n, heads; `d_model2` -> d, model, 2."""
    return [w.lower() for w in re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+", name)]


def _walk(value):
    if isinstance(value, dict):
        for v in value.values():
            yield from _walk(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _walk(v)
    else:
        yield value


def substitute(value, env: dict[str, int]):
    """Replace `$name` strings by their values, anywhere inside `value`."""
    if isinstance(value, str) and value.startswith("$"):
        return env[value]
    if isinstance(value, dict):
        return {k: substitute(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [substitute(v, env) for v in value]
    return value
