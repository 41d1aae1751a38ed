"""Runs PyTorch's module database (module_db, what PyTorch's own test_modules.py runs on every device) on the tpu
device against the CPU.

For each ModuleInfo and each of its float32 inputs (`module_inputs_func(..., training=...)`), in training mode
(with autograd) and in eval mode under `torch.no_grad()` (as evaluation loops run):

- the module is built on the CPU and copied to tpu (`copy.deepcopy(module).to("tpu")`: the same parameters and
  buffers; a lazy module is copied uninitialised and materialises on tpu at its first call, after which the CPU's
  materialised values are copied over);
- both run the same inputs; their outputs and their buffers after the forward (running statistics) are compared;
- in training mode, the same random output gradients are back-propagated on both, and the gradients of the inputs
  and of the parameters are compared;
- the tpu module's `state_dict()` goes through the CPU: `torch.save` then `torch.load` (no map_location: it comes
  back on tpu, as PyTorch restores a device's tensors to their device), its keys and values equal the CPU
  module's, and a fresh tpu copy loads it (`load_state_dict`) and reads it back equal.

Modes (`MODES`): eager (op by op), fused (`torch.tpu.set_eager_mode(DEFER_AND_FUSE)`: ops recorded, run as one
program when a value is read) and compiled steps (the module's forward and backward as programs, as
`TPU_AGENT_COMPILE_STEPS=1` compiles the model it finds, and a training step closed by `torch.tpu.mark_step()`).

Usable as a script: `python tests/backend/module_db_check.py [eager|fused|compiled] [--most N] [names...]` prints
one line per failing case and the counts (`--most N`: N inputs per module and training mode, spread over its list).
"""

from __future__ import annotations

import copy
import io
import sys
import warnings
from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_flatten, tree_map

MODES = ("eager", "fused", "compiled")
RTOL, ATOL = 1.3e-5, 1e-5  # float32: torch.testing's rtol, and an absolute floor for values near zero
# A gradient's absolute floor grows with its largest entry: an element near zero is a difference of large terms,
# rounded differently by any two float32 implementations. nn.MultiheadAttention's in_proj_weight gradients (entries
# up to 73) differ from float64 by up to 7e-5 on the CPU itself, and by as much on tpu.
GRAD_ATOL = 1e-5
INPUT_SEED = 0  # module_inputs_func draws its inputs from the global RNG: the same inputs in every run


@dataclass
class CaseResult:
    module: str
    training: bool
    desc: str
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def name(self) -> str:
        return f"{self.module}[{'train' if self.training else 'eval'}]{'(' + self.desc + ')' if self.desc else ''}"


@dataclass
class ModuleResult:
    module: str
    cases: list[CaseResult] = field(default_factory=list)

    @property
    def failures(self) -> list[CaseResult]:
        return [c for c in self.cases if not c.ok]

    @property
    def ok(self) -> bool:
        return bool(self.cases) and not self.failures


def module_infos() -> dict:
    from torch.testing._internal.common_modules import module_db

    return {info.name: info for info in module_db}


def _to_tpu(x):
    if isinstance(x, torch.Tensor):
        y = x.detach().to("tpu")
        return y.requires_grad_(x.requires_grad) if x.is_floating_point() else y
    return x


def _fresh(x):
    if isinstance(x, torch.Tensor):
        y = x.detach().clone()
        return y.requires_grad_(x.requires_grad) if x.is_floating_point() else y
    return x


def _cpu(x):
    return x.cpu() if isinstance(x, torch.Tensor) and x.device.type == "tpu" else x


def _close(actual, expected, what: str, scaled: bool = False) -> None:
    """`scaled`: gradients, whose absolute floor is GRAD_ATOL times the largest magnitude (at least 1) in each."""
    a, a_spec = tree_flatten(tree_map(_cpu, actual))
    e, e_spec = tree_flatten(expected)
    if a_spec != e_spec:
        raise AssertionError(f"{what}: structure {a_spec} != {e_spec}")
    for i, (x, y) in enumerate(zip(a, e)):
        where = what if len(a) == 1 else f"{what}[{i}]"
        if isinstance(y, torch.Tensor):
            if not isinstance(x, torch.Tensor):
                raise AssertionError(f"{where}: {type(x).__name__}, expected a tensor")
            if x.device.type != "cpu":
                raise AssertionError(f"{where}: on {x.device}, expected a tpu tensor")
            atol = ATOL
            if scaled and y.numel() and y.is_floating_point():
                atol = GRAD_ATOL * max(1.0, float(y.detach().abs().nan_to_num(0.0, 0.0, 0.0).max()))
            torch.testing.assert_close(x, y, rtol=RTOL, atol=atol, equal_nan=True, check_stride=False,
                                       msg=lambda m, w=where: f"{w}: {m}")
        elif x != y and not (x != x and y != y):
            raise AssertionError(f"{where}: {x!r} != {y!r}")


def _outputs_on_tpu(out) -> None:
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor) and t.device.type != "tpu":
            raise AssertionError(f"an output is on {t.device}, not tpu")


def _materialise_lazy(cpu_module, tpu_module, cargs, ckwargs, targs, tkwargs) -> None:
    """A lazy module's first call on each device infers its shapes; then the CPU's initial values are copied."""
    with torch.no_grad():
        cpu_module(*cargs, **ckwargs)
        tpu_module(*targs, **tkwargs)
        if tpu_module.has_uninitialized_params() if hasattr(tpu_module, "has_uninitialized_params") else False:
            raise AssertionError("the lazy module did not materialise on tpu")
        tpu_state = tpu_module.state_dict()
        for name, value in cpu_module.state_dict().items():
            if tpu_state[name].device.type != "tpu":
                raise AssertionError(f"lazy {name} materialised on {tpu_state[name].device}")
            tpu_state[name].copy_(value)


def _floating_outputs(out) -> list[torch.Tensor]:
    return [t for t in tree_flatten(out)[0]
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]


def _grads(tensors) -> list:
    return [t.grad for t in tree_flatten(tensors)[0] if isinstance(t, torch.Tensor) and t.requires_grad]


def _state_dict_round_trip(cpu_module, tpu_module) -> None:
    expected = cpu_module.state_dict()
    state = tpu_module.state_dict()
    if list(state) != list(expected):
        raise AssertionError(f"state_dict keys {list(state)} != the CPU's {list(expected)}")
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf)
    for key, value in loaded.items():
        if isinstance(value, torch.Tensor) and value.device.type != "tpu":
            raise AssertionError(f"state_dict[{key!r}] saved from tpu loaded on {value.device}")
    _close(dict(loaded), dict(expected), "state_dict")
    fresh = copy.deepcopy(cpu_module)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    fresh = fresh.to("tpu")
    fresh.load_state_dict({k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in loaded.items()})
    _close(dict(fresh.state_dict()), dict(expected), "state_dict loaded into a fresh tpu module")


def _mode(mode: str):
    if mode == "fused":
        return torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE)
    import contextlib

    return contextlib.nullcontext()


def _compiled(module):
    """The module as compiled steps compile the model they find: forward and backward programs, a call with
    gradients opening a step window (closed by the step boundary, `mark_step`)."""
    from tpu_agent.backend.compiled import auto_compile

    return auto_compile.compile_module(module, whole_step=True)


class RanAsWritten(AssertionError):
    """Compiled steps ran the module as written, not as one program: every value matched the CPU's."""


def check_case(info, module_input, training: bool, mode: str) -> CaseResult:
    result = CaseResult(info.name, training, module_input.desc)
    try:
        _check_case(info, module_input, training, mode)
    except Exception as exc:  # noqa: BLE001 - recorded, reported
        text = str(exc).strip().splitlines()
        result.error = f"{type(exc).__name__}: {text[0][:300] if text else ''}"
    finally:
        if mode == "compiled":
            _end_step()
    return result


def _end_step() -> None:
    """A case that failed inside its step leaves no step window open (the next case would run fused), and the
    compiled module is forgotten (compiled steps keep the models they found)."""
    from tpu_agent.backend.compiled import auto_compile
    from tpu_agent.backend.compiled.whole_step import WINDOW

    if WINDOW.open:
        try:
            torch.tpu.mark_step()
        except Exception:  # noqa: BLE001 - the case has its error already
            pass
        WINDOW.end("module_db case")
    auto_compile.STATE.modules.clear()


def _check_case(info, module_input, training: bool, mode: str) -> None:
    cons, fwd = module_input.constructor_input, module_input.forward_input
    torch.manual_seed(0)
    cpu_module = info.module_cls(*cons.args, **cons.kwargs).to(torch.float32)
    tpu_module = copy.deepcopy(cpu_module).to("tpu")
    cpu_module.train(training)
    tpu_module.train(training)
    cargs, ckwargs = tree_map(_fresh, (fwd.args, fwd.kwargs))
    targs, tkwargs = tree_map(_to_tpu, (fwd.args, fwd.kwargs))
    with _mode(mode):
        if info.is_lazy:
            _materialise_lazy(cpu_module, tpu_module, cargs, ckwargs, targs, tkwargs)
        if mode == "compiled":
            compiled = _compiled(tpu_module)
        with torch.set_grad_enabled(training):
            torch.manual_seed(1)
            expected = cpu_module(*cargs, **ckwargs)
            actual = tpu_module(*targs, **tkwargs)
            if training:
                outs, touts = _floating_outputs(expected), _floating_outputs(actual)
                if len(outs) != len(touts):
                    raise AssertionError(f"{len(touts)} outputs require grad on tpu, {len(outs)} on the CPU")
                if outs:
                    gen = torch.Generator().manual_seed(2)
                    grads = [torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in outs]
                    torch.autograd.backward(outs, grads)
                    torch.autograd.backward(touts, [g.to("tpu") for g in grads])
        as_written = None
        if mode == "compiled":
            torch.tpu.mark_step()
            as_written = compiled.reason_not_compiled
        _outputs_on_tpu(actual)
        _close(actual, expected, "output")
        _close(dict(tpu_module.named_buffers()), dict(cpu_module.named_buffers()), "buffers after forward")
        if training:
            _close(_grads((targs, tkwargs)), _grads((cargs, ckwargs)), "input grads", scaled=True)
            names = [n for n, p in cpu_module.named_parameters() if p.requires_grad]
            tgrads = dict((n, p.grad) for n, p in tpu_module.named_parameters())
            _close([tgrads.get(n) for n in names], [dict(cpu_module.named_parameters())[n].grad for n in names],
                   "parameter grads", scaled=True)
        _state_dict_round_trip(cpu_module, tpu_module)
        if as_written is not None:  # the values matched; not being one program is its own failure
            raise RanAsWritten(f"compiled steps ran it as written: {as_written}")


def spread(items: list, most: int | None) -> list:
    """At most `most` of `items`, spread evenly from the first to the last (all of them when `most` is None)."""
    if most is None or len(items) <= most:
        return items
    if most == 1:
        return items[:1]
    return [items[round(k * (len(items) - 1) / (most - 1))] for k in range(most)]


def module_inputs(info, training: bool, most: int | None = None) -> list:
    torch.manual_seed(INPUT_SEED)
    inputs = [mi for mi in info.module_inputs_func(info, device="cpu", dtype=torch.float32, requires_grad=training,
                                                    training=training) if mi.forward_input is not None]
    return spread(inputs, most)


def check_module(info, mode: str, most: int | None = None, trainings=(True, False)) -> ModuleResult:
    """Every float32 input of the module (or `most` of them per training mode, spread over its list)."""
    result = ModuleResult(info.name)
    if torch.float32 not in info.supported_dtypes("cpu"):
        return result
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for training in trainings:
            for module_input in module_inputs(info, training, most):
                result.cases.append(check_case(info, module_input, training, mode))
    return result


def main(argv: list[str]) -> int:
    import time

    import tpu_agent.backend  # noqa: F401 - the device (also registered by torch's autoload)

    most = None
    if "--most" in argv:
        at = argv.index("--most")
        most = int(argv[at + 1])
        argv = argv[:at] + argv[at + 2:]
    mode = argv[0] if argv and argv[0] in MODES else "eager"
    names = [a for a in argv if a not in MODES]
    infos = module_infos()
    cases = modules = passed_cases = passed_modules = 0
    start = time.perf_counter()
    for name, info in infos.items():
        if names and name not in names:
            continue
        t0 = time.perf_counter()
        r = check_module(info, mode, most)
        modules += bool(r.cases)
        passed_modules += r.ok
        cases += len(r.cases)
        passed_cases += sum(c.ok for c in r.cases)
        for c in r.failures:
            print(f"FAIL {mode} {c.name}: {c.error}", flush=True)
        print(f"# {name} {len(r.cases) - len(r.failures)}/{len(r.cases)} {time.perf_counter() - t0:.1f}s", flush=True)
    print(f"module_db {mode}: {passed_cases}/{cases} cases, {passed_modules}/{modules} modules pass "
          f"({time.perf_counter() - start:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
