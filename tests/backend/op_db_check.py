"""Runs PyTorch's operator database (op_db) on the tpu device against the CPU.

Forward: for each OpInfo, every float32 sample is run on CPU and on tpu and the
results compared (torch.testing tolerances for float32).

Arguments: after each forward sample, every tensor argument on tpu is compared with the CPU's after its run, so
that an op which writes into its inputs (in-place variants, batch norm's running statistics, which
`native_batch_norm`'s schema does not even mark as written) is held to the CPU's writes, not only its outputs.

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

import itertools
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch
from torch.utils._pytree import tree_flatten, tree_map

MAX_SAMPLES = 12


@dataclass
class OpResult:
    name: str
    samples: int = 0
    passed: int = 0
    error: str = ""
    # Samples compared by shape and dtype alone: their CPU result changes with the seed.
    seeded: int = 0
    # Samples whose CPU run wrote into one of its tensor arguments (compared after the call on both devices),
    # and those whose arguments after the tpu call differ from the CPU's.
    writes: int = 0
    write_errors: int = 0

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


def _device_kwarg(kwargs):
    """A sample's `device=` names the device the samples were made for (the CPU here): on the
    tpu side it must name tpu, as PyTorch's device tests make samples for the device tested."""
    device = kwargs.get("device")
    if device is not None and torch.device(device).type == "cpu":
        return {**kwargs, "device": "tpu"}
    return kwargs


# Positional arguments PyTorch requires on the CPU whatever the device, which the OpInfo's
# samples create there (no device=): PyTorch's device tests pass them on the CPU, so the tpu
# side gets them on the CPU too (tensor_split's tensor_indices_or_sections).
_HOST_ARGS = {"tensor_split": (1,)}


def _host_args(opinfo, args, targs):
    keep = _HOST_ARGS.get(opinfo.name, ())
    return tuple(a if i in keep and isinstance(a, torch.Tensor) else t for i, (a, t) in enumerate(zip(args, targs)))


def _to_cpu(x):
    if isinstance(x, torch.Tensor) and x.device.type == "tpu":
        return x.cpu()
    return x


class _Timeout(Exception):
    pass


_IN_WORKER = False
_fired = False  # the alarm went off: an error it caused inside autograd's C++ may not be a _Timeout


def _alarm(signum, frame):
    global _fired
    _fired = True
    if _IN_WORKER:  # the timeout may unwind through autograd's C++ and kill the worker: say so first
        print(json.dumps({"alarm": True}), flush=True)
    raise _Timeout()


def _name(opinfo) -> str:
    return opinfo.name if not opinfo.variant_test_name else f"{opinfo.name}.{opinfo.variant_test_name}"


def _close(actual, expected):
    torch.testing.assert_close(actual, expected, equal_nan=True, check_device=False,
                               check_stride=False, atol=1e-4, rtol=1.3e-5)


def _record(result: OpResult, exc: Exception) -> None:
    if not result.error:
        result.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


def _first(samples, n: int) -> list:
    """The first `n` of an OpInfo's samples, made before any runs as the whole list was, without making the rest:
    op_db's sample iterator seeds the global RNG before each sample (torch.testing's TrackedInputIter), so the
    first n are the same tensors either way. Making every sample of every op to keep one (each seeded by a
    torch.manual_seed, which without CUDA formats a stack for CUDA's lazy queue) took about 7 s of the check's
    ~100; the rest is XLA compiling each op's programs."""
    return list(itertools.islice(samples, n))


def check_op(opinfo, max_samples: int = MAX_SAMPLES, seconds: int = 20) -> OpResult:
    result = OpResult(_name(opinfo))
    if torch.float32 not in opinfo.supported_dtypes("cpu"):
        return result
    with _time_limit(result, seconds):
        for sample in _first(opinfo.sample_inputs("cpu", torch.float32, requires_grad=False), max_samples):
            result.samples += 1
            args, post, (targs, tkwargs, _), (cargs, ckwargs, _) = _prepared(opinfo, sample)
            before = _snapshot((args, sample.kwargs))
            try:
                torch.manual_seed(0)
                expected = post(opinfo.op(*args, **sample.kwargs))
                random = _is_random(opinfo) or _seed_dependent(opinfo, lambda: post(opinfo.op(*cargs, **ckwargs)), expected)
            except Exception:
                result.samples -= 1  # the CPU itself rejects this sample
                continue
            result.seeded += random and not _is_random(opinfo)
            result.writes += _changed(before, (args, sample.kwargs))
            try:
                actual = post(tree_map(_to_cpu, opinfo.op(*targs, **tkwargs)))
                if random:
                    _compare_meta(actual, expected)
                else:
                    _compare_arguments((targs, tkwargs), (args, sample.kwargs))
                    _close(actual, expected)
                result.passed += 1
            except _Timeout:
                raise
            except Exception as exc:  # noqa: BLE001 - recorded, reported
                result.write_errors += isinstance(exc, WrittenArgumentMismatch)
                _record(result, exc)
    return result


@contextmanager
def _time_limit(result: OpResult, seconds: int):
    """One alarm for an op's samples: a timeout, or a failure while sampling, ends the op with its error."""
    global _fired
    _fired = False
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(seconds)
    try:
        yield
    except _Timeout:
        result.error = result.error or f"timeout after {seconds}s"
    except Exception as exc:  # noqa: BLE001
        result.error = result.error or f"{type(exc).__name__} while sampling: {str(exc)[:120]}"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _prepared(opinfo, sample):
    """The sample's arguments, its post-processing of results that are not unique (eigenvectors up to sign:
    their abs, as PyTorch's test_compare_cpu and gradient tests apply), and the arguments moved to tpu and
    copied on the CPU, each with its (tensor, copy) pairs that require grad. Copies first: a CPU run may update
    its arguments (in-place ops, batch norm's running stats)."""
    args = (sample.input,) + tuple(sample.args)
    targs, tkwargs, pairs = _moved(args, _device_kwarg(sample.kwargs), _to_tpu)
    return (args, sample.output_process_fn_grad, (_host_args(opinfo, args, targs), tkwargs, pairs),
            _moved(args, sample.kwargs, _cpu_copy))


class WrittenArgumentMismatch(AssertionError):
    """An argument after the tpu call differs from the same argument after the CPU's."""


def _compare_arguments(actual, expected) -> None:
    """Every tensor argument after the tpu call against the same argument after the CPU's: what an op writes
    into its inputs is part of its result."""
    a, _ = tree_flatten(actual)  # the specs may differ in container types (a torch.Size moved becomes a tuple)
    e, _ = tree_flatten(expected)
    assert len(a) == len(e), f"the arguments moved to tpu flatten to {len(a)} leaves, the CPU's to {len(e)}"
    for i, (x, y) in enumerate(zip(a, e)):
        if isinstance(y, torch.Tensor) and x is not y:
            try:
                _close(_to_cpu(x.detach()), y.detach())
            except AssertionError as exc:
                raise WrittenArgumentMismatch(f"argument {i} after the call (written in place): {exc}") from None


def _snapshot(tree) -> list:
    return [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in tree_flatten(tree)[0]]


def _changed(before: list, tree) -> bool:
    """Whether a run changed one of the tensor arguments snapshotted before it."""
    for x, y in zip(tree_flatten(tree)[0], before):
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.layout == y.layout == torch.strided:
            if x.shape != y.shape or not torch.equal(x.detach().nan_to_num(), y.nan_to_num()):
                return True
    return False


def _cpu_copy(x):
    y = x.detach().clone()
    return y.requires_grad_(x.requires_grad) if x.is_floating_point() else y


def _moved(args, kwargs, move):
    """The call's arguments with every tensor replaced by move(tensor) (the same tensor once),
    and the pairs (tensor, its copy) of those that require grad, in argument order."""
    copies: dict[int, torch.Tensor] = {}
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def one(x):
        if not isinstance(x, torch.Tensor):
            return x
        if id(x) not in copies:
            copies[id(x)] = move(x)
            if x.requires_grad:
                pairs.append((x, copies[id(x)]))
        return copies[id(x)]

    return tree_map(one, args), tree_map(one, kwargs), pairs


def _seed_dependent(opinfo, call, expected) -> bool:
    """Whether the CPU result changes with the seed: a random sample (dropout in training,
    rrelu, randomized algorithms), whose values no other RNG reproduces. OpInfos of random
    ops pin the seed with torch.testing's wrapper_set_seed (42): for the rerun it pins another."""
    scope = getattr(opinfo.op, "__globals__", {})
    pinned = scope.get("wrapper_set_seed")

    def other_seed(op, *args, **kwargs):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(43)
            return op(*args, **kwargs)

    torch.manual_seed(1)
    if pinned is not None:
        scope["wrapper_set_seed"] = other_seed
    try:
        again = call()
    except Exception:
        return False
    finally:
        if pinned is not None:
            scope["wrapper_set_seed"] = pinned
    a, a_spec = tree_flatten(again)
    e, e_spec = tree_flatten(expected)
    if a_spec != e_spec:
        return True
    for x, y in zip(a, e):
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            try:
                torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)
            except AssertionError:
                return True
        elif x is not y and x != y:
            return True
    return False


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
    with _time_limit(result, seconds):
        for sample in _first(opinfo.sample_inputs("cpu", torch.float32, requires_grad=True), max_samples):
            result.samples += 1
            args, post, (targs, tkwargs, pairs), (cargs, ckwargs, cpairs) = _prepared(opinfo, sample)
            try:
                torch.manual_seed(0)
                expected = _grads(_loss(post(opinfo.op(*args, **sample.kwargs))), [c for c, _ in pairs])
                random = _is_random(opinfo) or _seed_dependent(
                    opinfo, lambda: _grads(_loss(post(opinfo.op(*cargs, **ckwargs))), [c for _, c in cpairs]), expected)
            except Exception:
                result.samples -= 1  # the CPU itself rejects this sample (or it has nothing to differentiate)
                continue
            result.seeded += random and not _is_random(opinfo)
            try:
                actual = _grads(_loss(post(opinfo.op(*targs, **tkwargs))), [t for _, t in pairs])
                for i, (a, e) in enumerate(zip(actual, expected)):
                    if a is None or e is None:
                        assert a is None and e is None, f"input {i}: the grad is None on one device only"
                        continue
                    a = a.cpu()
                    if random:
                        _compare_meta(a, e)
                    else:
                        _close(a, e)
                result.passed += 1
            except _Timeout:
                raise
            except Exception as exc:  # noqa: BLE001 - recorded, reported
                if _fired:  # the timeout, come back through autograd's C++ as another error
                    raise _Timeout() from exc
                _record(result, exc)
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


def _selected(names: list[str] | None, shard: tuple[int, int] | None = None) -> list[int]:
    """op_db's indices (those named, else all); `shard=(k, n)` keeps every n-th from the k-th, so that each
    part holds ops of every family."""
    from torch.testing._internal.common_methods_invocations import op_db

    chosen = [i for i, o in enumerate(op_db) if not names or o.name in names or _name(o) in names]
    return chosen if shard is None else chosen[shard[0]::shard[1]]


def run(names: list[str] | None = None, max_samples: int = MAX_SAMPLES, grad_samples: int | None = None,
        forward: bool = True, grad: bool = True, shard: tuple[int, int] | None = None) -> Summary:
    """Both checks over op_db (or the OpInfos named, or one shard of them); grad_samples defaults to max_samples.

    Both run in a worker process, each OpInfo's forward check and then its gradient check, so that the gradient
    check's forward runs the programs the forward check compiled: an error raised by a tpu op inside one of
    autograd's C++ backward nodes can abort the process (see _worker), so a worker that dies is restarted after
    the check it was running, which is reported as failed.
    """
    indices = _selected(names, shard)
    parts = (("forward",) if forward else ()) + (("gradients",) if grad else ())
    results = run_isolated([(i, part) for i in indices for part in parts], max_samples,
                           max_samples if grad_samples is None else grad_samples)
    return Summary(results=[results[i, "forward"] for i in indices if (i, "forward") in results],
                   grad_results=[results[i, "gradients"] for i in indices if (i, "gradients") in results])


def run_isolated(todo: list[tuple[int, str]], max_samples: int, grad_samples: int,
                 seconds: int = 20) -> dict[tuple[int, str], OpResult]:
    """Each (op_db index, "forward" or "gradients") checked in turn, in worker processes that may die."""
    from torch.testing._internal.common_methods_invocations import op_db

    results: dict[tuple[int, str], OpResult] = {}
    while todo:
        with tempfile.TemporaryFile() as err:
            worker = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--worker", str(max_samples), str(grad_samples),
                 str(seconds)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
            )
            worker.stdin.write(json.dumps(todo) + "\n")
            worker.stdin.close()
            current, alarm = None, False
            while True:
                # The worker's own alarm ends a slow op; this catches a worker that hangs outright.
                ready, _, _ = select.select([worker.stdout], [], [], seconds * 3 + 60)
                line = worker.stdout.readline() if ready else ""
                if not line:
                    break
                msg = json.loads(line)
                if "alarm" in msg:
                    alarm = True
                elif "begin" in msg:
                    current, alarm = tuple(msg["begin"]), False
                else:
                    results[tuple(msg["check"])] = OpResult(**msg["result"])
                    current = None
            if worker.poll() is None:
                worker.kill()
            worker.wait()
            err.seek(0)
            tail = [ln for ln in err.read().decode(errors="replace").splitlines() if ln.strip()][-1:]
        done = set(results)
        if current is not None:
            why = f"worker process died ({tail[0][:120] if tail else f'exit {worker.returncode}'})"
            error = f"timeout after {seconds}s ({why})" if alarm else f"Crash: {why}"
            results[current] = OpResult(_name(op_db[current[0]]), samples=1, error=error)
            done.add(current)
        rest = [c for c in todo if c not in done]
        if rest == todo:  # no progress: the worker cannot start
            raise RuntimeError(f"the op_db worker failed to start: {tail}")
        todo = rest
    return results


def _worker(max_samples: int, grad_samples: int, seconds: int) -> int:
    """Run the (op_db index, part) checks read from stdin, one JSON line per event.

    An exception raised by a tpu op inside a C++ autograd node (an unsupported backward op)
    unwinds through PyTorch's stream guard, whose Python-device implementation calls into
    Python with the error still pending, inside a noexcept destructor: std::terminate.
    """
    from torch.testing._internal.common_methods_invocations import op_db

    global _IN_WORKER
    _IN_WORKER = True
    for i, part in json.loads(sys.stdin.readline()):
        print(json.dumps({"begin": [i, part]}), flush=True)
        if part == "forward":
            result = check_op(op_db[i], max_samples, seconds)
        else:
            result = check_op_grad(op_db[i], grad_samples, seconds)
        print(json.dumps({"check": [i, part], "result": asdict(result)}), flush=True)
    return 0


def report(label: str, results: list[OpResult]) -> str:
    tested = _tested(results)
    passed = sum(r.ok for r in tested)
    return f"op_db float32 {label}: {passed}/{len(tested)} ops fully pass ({_rate(results):.1%})"


def main(argv: list[str]) -> int:
    if argv[:1] == ["--worker"]:
        return _worker(int(argv[1]), int(argv[2]), int(argv[3]))
    summary = run(argv or None)
    for label, results in (("forward", summary.results), ("gradients", summary.grad_results)):
        failures = [r for r in _tested(results) if not r.ok]
        for r in failures:
            print(f"FAIL {label} {r.name}: {r.passed}/{r.samples} {r.error}")
        reasons = Counter(r.error.split(":")[0] for r in failures)
        print(f"{label} failure kinds:", dict(reasons.most_common(10)))
        seeded = sorted(r.name for r in _tested(results) if r.seeded)
        print(f"{label}: {len(seeded)} ops have samples whose CPU result depends on the seed, "
              f"compared by shape and dtype: {', '.join(seeded)}")
    print(report("forward", summary.results))
    print(report("gradients", summary.grad_results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
