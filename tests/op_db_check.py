"""Runs PyTorch's operator database (op_db) on the tpu device against the CPU.

For each OpInfo, every float32 forward sample is run on CPU and on tpu and the
results compared (torch.testing tolerances for float32). An op "fully passes"
when all of its samples match. Usable as a script: prints the pass rate and the
failures, one line each.
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


@dataclass
class Summary:
    results: list[OpResult] = field(default_factory=list)

    @property
    def tested(self) -> list[OpResult]:
        return [r for r in self.results if r.samples or r.error]

    @property
    def pass_rate(self) -> float:
        tested = self.tested
        return sum(r.ok for r in tested) / max(len(tested), 1)


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


def check_op(opinfo, max_samples: int = MAX_SAMPLES, seconds: int = 20) -> OpResult:
    result = OpResult(opinfo.name if not opinfo.variant_test_name else f"{opinfo.name}.{opinfo.variant_test_name}")
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
                    torch.testing.assert_close(actual, expected, equal_nan=True, check_device=False,
                                               check_stride=False, atol=1e-4, rtol=1.3e-5)
                result.passed += 1
            except _Timeout:
                raise
            except Exception as exc:  # noqa: BLE001 - recorded, reported
                if not result.error:
                    result.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
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


def run(names: list[str] | None = None, max_samples: int = MAX_SAMPLES) -> Summary:
    from torch.testing._internal.common_methods_invocations import op_db

    summary = Summary()
    for opinfo in op_db:
        if names and opinfo.name not in names:
            continue
        summary.results.append(check_op(opinfo, max_samples))
    return summary


def main(argv: list[str]) -> int:
    summary = run(argv or None)
    tested = summary.tested
    failures = [r for r in tested if not r.ok]
    for r in failures:
        print(f"FAIL {r.name}: {r.passed}/{r.samples} {r.error}")
    reasons = Counter(r.error.split(":")[0] for r in failures)
    print("failure kinds:", dict(reasons.most_common(10)))
    print(f"op_db float32 forward: {len(tested) - len(failures)}/{len(tested)} ops fully pass ({summary.pass_rate:.1%})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
