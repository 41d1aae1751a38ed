"""Shared set-up for every test. The helpers live in the `support` package (tests/support/).

`EXAMPLES` and the process helpers are re-exported here for the backend tests that still
import them from conftest (tests/test_sharding.py).
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import warnings

import pytest

# Tests build Hugging Face models from configs; nothing may reach the hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# XLA's compilation cache: shared by this run's workers and the processes they start (the
# same op programs compile once per run, not once per process), and never the user's own.
os.environ["TPU_AGENT_XLA_CACHE"] = os.path.join(
    tempfile.gettempdir(), f"tpu-agent-tests-xla-{os.environ.get('PYTEST_XDIST_TESTRUNUID', os.getpid())}")

# XLA compiles the tests' programs quickly, in this process and every one it starts: the tests check results,
# not speed, and much of their time is compiling. Without LLVM's optimisations, about 30 % less; with XLA:CPU's
# older loop emitters instead of its fusion emitters, a tiny BERT's whole-step programs compile in 4.0 s instead
# of 6.9 (2026-12-02, `python /tmp/wt.py`-style timing of compiler.backend_compile_and_load). The op_db check
# passes its floors either way. benchmarks/ measure with XLA's defaults.
QUICK_COMPILE_FLAGS = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
                       " --xla_cpu_use_fusion_emitters=false")
if QUICK_COMPILE_FLAGS not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {QUICK_COMPILE_FLAGS}".strip()

# PyTorch's CPU ops on one OpenMP thread, in this process and every one it starts (set before torch loads): the
# suite runs 2 workers on 2 cores, and a thread per core in each worker oversubscribes them, where OpenMP's
# spin-waiting turns a tiny model's CPU reference steps from milliseconds into seconds (a T5 test 49 s with the
# default, 29 s with one thread, back to back under load). A value set by the caller stays.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Python keeps the bytecode it compiles (__pycache__, ignored by git), in this process and every one it starts, where
# the environment says not to (PYTHONDONTWRITEBYTECODE=1): without it, each of the processes the suite starts
# compiled the tool's modules from source again (`tpu-agent --help` 344 -> 309 ms of CPU, `tpu-agent run` of the MLP
# example 4.55 -> 4.43 s, `import torch` 1.42 -> 1.38 s: medians of 5, back to back, load 2.3).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

# JAX narrows int64/float64 with this warning when the device calls it outside its 64-bit scope: an error in
# every process the tests start (the tool, its trials, torchrun's ranks), as pyproject's filterwarnings makes it
# in pytest's own.
os.environ.setdefault("PYTHONWARNINGS", "error:Explicitly requested dtype:UserWarning")

from support.paths import EXAMPLES, REPO, TPU_AGENT  # noqa: E402,F401 - re-exported
from support.processes import clean_env, one_error_line, run_python, run_tool  # noqa: E402,F401 - re-exported


def pytest_addoption(parser):
    parser.addoption("--store-durations", action="store_true",
                     help="update tests/durations.json (the order tests start in) with this run's call times")


def pytest_configure(config):
    if config.getoption("--store-durations") and not hasattr(config, "workerinput"):
        from support.durations import Recorder

        config.pluginmanager.register(Recorder(), "tpu-agent-durations")


@pytest.hookimpl(tryfirst=True)  # before `-m "not slow"` deselects by mark
def pytest_collection_modifyitems(config, items):
    from support.durations import mark_slow

    mark_slow(items)
    # The release matrix (`-m matrix`, docs/ci.md) runs only where a -m expression names it.
    if "matrix" not in (config.option.markexpr or ""):
        matrix = [item for item in items if item.get_closest_marker("matrix")]
        if matrix:
            config.hook.pytest_deselected(items=matrix)
            items[:] = [item for item in items if not item.get_closest_marker("matrix")]


@pytest.hookimpl(tryfirst=True)  # after every modifyitems reordering, before xdist sends the order it runs in
def pytest_collection_finish(session):
    from support.durations import longest_first

    worker = getattr(session.config, "workerinput", None)  # xdist's scheduler reads the workers' order
    longest_first(session.items, int(worker["workercount"]) if worker else 1)


@pytest.fixture(autouse=True)
def ctrl_c_reaches_the_processes_a_test_starts(request):
    """The processes a test starts inherit its worker's Ctrl-C disposition, and a terminal's job gets the
    default one. Some code run in-process leaves SIGINT ignored in its xdist worker; the Ctrl-C tests that ran
    after it then saw the tool sleep on (fresh-clone suites, 2026-12-02). Restored before each test, and the
    test that changed it is named in the warnings summary."""
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        warnings.warn(f"{request.node.nodeid} left SIGINT set to {signal.getsignal(signal.SIGINT)!r}; restored")
        signal.signal(signal.SIGINT, signal.default_int_handler)
