"""Runs PyTorch's operator database (op_db) on the tpu device against the CPU.

Forward: for each OpInfo, every float32 sample is run on CPU and on tpu and the
results compared (torch.testing tolerances for float32).

Gradients: for each OpInfo that supports autograd, every float32 sample with
requires_grad=True is run forward on both devices, the sum of the `.sum()` of
every floating-point output is differentiated, and the gradient of each input
that requires grad is compared with the CPU's (same tolerances; None on both
sides is equal).

An op "fully passes" a check when all of its samples match; samples the CPU
itself rejects are skipped. Usable as a script: prints both pass rates and the
failures of each, one line each.
"""

from __future__ import annotations

import signal
import sys
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_flatten, tree_map

MAX_SAMPLES = 12


@dataclass
class OpResult:
    name: str
    samples: int = 0
    passed: int = 0
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.samples > 0 and self.passed == self.samples and not self.error


def _tested(results: list[OpResult]) -> list[OpResult]:
    return [r for r in results if r.samples or r.error]


def _rate(results: list[OpResult]) -> float:
    tested = _tested(results)
    return sum(r.ok for r in tested) / max(len(tested), 1)


@dataclass
class Summary:
    results: list[OpResult] = field(default_factory=list)  # forward
    grad_results: list[OpResult] = field(default_factory=list)  # gradients

    @property
    def tested(self) -> list[OpResult]:
        return _tested(self.results)

    @property
    def pass_rate(self) -> float:
        return _rate(self.results)

    @property
    def grad_tested(self) -> list[OpResult]:
        return _tested(self.grad_results)

    @property
    def grad_pass_rate(self) -> float:
        return _rate(self.grad_results)


def _to_tpu(x):
    if isinstance(x, torch.Tensor):
        y = x.detach().to("tpu")
        return y.requires_grad_(x.requires_grad) if x.is_floating_point() else y
    return x


def _to_cpu(x):
    if isinstance(x, torch.Tensor) and x.device.type == "tpu":
        return x.cpu()
    return x


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def _name(opinfo) -> str:
    return opinfo.name if not opinfo.variant_test_name else f"{opinfo.name}.{opinfo.variant_test_name}"


def _close(actual, expected):
    torch.testing.assert_close(actual, expected, equal_nan=True, check_device=False,
                               check_stride=False, atol=1e-4, rtol=1.3e-5)


def _record(result: OpResult, exc: Exception) -> None:
    if not result.error:
        result.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


def check_op(opinfo, max_samples: int = MAX_SAMPLES, seconds: int = 20) -> OpResult:
    result = OpResult(_name(opinfo))
    if torch.float32 not in opinfo.supported_dtypes("cpu"):
        return result
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(seconds)
    try:
        samples = list(opinfo.sample_inputs("cpu", torch.float32, requires_grad=False))[:max_samples]
        for sample in samples:
            result.samples += 1
            args = (sample.input,) + tuple(sample.args)
            try:
                torch.manual_seed(0)
                expected = opinfo.op(*args, **sample.kwargs)
            except Exception:
                result.samples -= 1  # the CPU itself rejects this sample
                continue
            try:
                targs = tree_map(_to_tpu, args)
                tkwargs = tree_map(_to_tpu, sample.kwargs)
                actual = tree_map(_to_cpu, opinfo.op(*targs, **tkwargs))
                if _is_random(opinfo):
                    _compare_meta(actual, expected)
                else:
                    _close(actual, expected)
                result.passed += 1
            except _Timeout:
                raise
            except Exception as exc:  # noqa: BLE001 - recorded, reported
                _record(result, exc)
    except _Timeout:
        result.error = result.error or f"timeout after {seconds}s"
    except Exception as exc:  # noqa: BLE001
        result.error = result.error or f"{type(exc).__name__} while sampling: {str(exc)[:120]}"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    return result


def _grad_leaves(args, kwargs):
    """The call's arguments with every tensor moved to tpu (the same tensor once), and the
    pairs (CPU tensor, its tpu copy) of those that require grad, in argument order."""
    copies: dict[int, torch.Tensor] = {}
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def move(x):
        if not isinstance(x, torch.Tensor):
            return x
        if id(x) not in copies:
            copies[id(x)] = _to_tpu(x)
            if x.requires_grad:
                pairs.append((x, copies[id(x)]))
        return copies[id(x)]

    return tree_map(move, args), tree_map(move, kwargs), pairs


def _loss(out) -> torch.Tensor:
    """The sum of the `.sum()` of every floating-point output."""
    sums = [t.sum() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not sums:
        raise ValueError("no floating-point output")
    return torch.stack(sums).sum() if len(sums) > 1 else sums[0]


def _grads(loss, inputs) -> list:
    return list(torch.autograd.grad(loss, inputs, allow_unused=True))


def check_op_grad(opinfo, max_samples: int = MAX_SAMPLES, seconds: int = 20) -> OpResult:
    """The gradients of every float32 sample on tpu against the CPU's."""
    result = OpResult(_name(opinfo))
    if not opinfo.supports_autograd or torch.float32 not in opinfo.supported_dtypes("cpu"):
        return result
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(seconds)
    try:
        samples = list(opinfo.sample_inputs("cpu", torch.float32, requires_grad=True))[:max_samples]
        for sample in samples:
            result.samples += 1
            args = (sample.input,) + tuple(sample.args)
            # The tpu copies first: a CPU run may update arguments (batch norm's running stats).
            targs, tkwargs, pairs = _grad_leaves(args, sample.kwargs)
            try:
                torch.manual_seed(0)
                expected = _grads(_loss(opinfo.op(*args, **sample.kwargs)), [c for c, _ in pairs])
            except Exception:
                result.samples -= 1  # the CPU itself rejects this sample (or it has nothing to differentiate)
                continue
            try:
                actual = _grads(_loss(opinfo.op(*targs, **tkwargs)), [t for _, t in pairs])
                for i, (a, e) in enumerate(zip(actual, expected)):
                    if a is None or e is None:
                        assert a is None and e is None, f"input {i}: grad is {a is None and 'None' or 'a tensor'} on tpu, not on CPU"
                        continue
                    a = a.cpu()
                    if _is_random(opinfo):
                        _compare_meta(a, e)
                    else:
                        _close(a, e)
                result.passed += 1
            except _Timeout:
                raise
            except Exception as exc:  # noqa: BLE001 - recorded, reported
                _record(result, exc)
    except _Timeout:
        result.error = result.error or f"timeout after {seconds}s"
    except Exception as exc:  # noqa: BLE001
        result.error = result.error or f"{type(exc).__name__} while sampling: {str(exc)[:120]}"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    return result


def _is_random(opinfo) -> bool:
    return bool(getattr(opinfo, "randomness", False)) or opinfo.name in {
        "bernoulli", "normal", "rand_like", "randn_like", "randint_like", "randint", "multinomial", "uniform",
        "nn.functional.dropout", "nn.functional.alpha_dropout", "nn.functional.feature_alpha_dropout",
        "nn.functional.dropout2d", "nn.functional.dropout3d", "empty", "empty_like", "new_empty",
        "new_empty_strided", "empty_strided", "empty_permuted", "randn", "rand", "cauchy", "exponential",
        "geometric", "log_normal",
    }


def _compare_meta(actual, expected):
    a, _ = tree_flatten(actual)
    e, _ = tree_flatten(expected)
    assert len(a) == len(e)
    for x, y in zip(a, e):
        if isinstance(y, torch.Tensor):
            assert x.shape == y.shape and x.dtype == y.dtype, (x.shape, y.shape, x.dtype, y.dtype)


def run(names: list[str] | None = None, max_samples: int = MAX_SAMPLES, grad_samples: int | None = None,
        forward: bool = True, grad: bool = True) -> Summary:
    """Both checks over op_db (or the OpInfos named); grad_samples defaults to max_samples."""
    from torch.testing._internal.common_methods_invocations import op_db

    summary = Summary()
    for opinfo in op_db:
        if names and opinfo.name not in names and _name(opinfo) not in names:
            continue
        if forward:
            summary.results.append(check_op(opinfo, max_samples))
        if grad:
            summary.grad_results.append(check_op_grad(opinfo, max_samples if grad_samples is None else grad_samples))
    return summary


def report(label: str, results: list[OpResult]) -> str:
    tested = _tested(results)
    passed = sum(r.ok for r in tested)
    return f"op_db float32 {label}: {passed}/{len(tested)} ops fully pass ({_rate(results):.1%})"


def main(argv: list[str]) -> int:
    summary = run(argv or None)
    for label, results in (("forward", summary.results), ("gradients", summary.grad_results)):
        failures = [r for r in _tested(results) if not r.ok]
        for r in failures:
            print(f"FAIL {label} {r.name}: {r.passed}/{r.samples} {r.error}")
        reasons = Counter(r.error.split(":")[0] for r in failures)
        print(f"{label} failure kinds:", dict(reasons.most_common(10)))
    print(report("forward", summary.results))
    print(report("gradients", summary.grad_results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
