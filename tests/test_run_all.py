"""benchmarks/run_all.py: the one command that runs every benchmark the docs quote.

Its list must hold every benchmark script that README.md and docs/benchmarks.md name (a new benchmark quoted in
the docs and left out of the command fails here), and its quick mode must run: one benchmark's smoke run here,
end to end, with the header each table is printed under (date, load, commit, versions)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _run_all():
    spec = importlib.util.spec_from_file_location("run_all", REPO / "benchmarks" / "run_all.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("run_all", module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _scripts(bench) -> set[str]:
    return {Path(arg).name for command in (*bench.full, *bench.quick) for arg in command if arg.startswith("benchmarks/")}


def test_every_benchmark_the_docs_name_is_in_the_command():
    run_all = _run_all()
    listed = set().union(*(_scripts(b) for b in run_all.BENCHMARKS))
    named = set()
    for doc in (REPO / "README.md", REPO / "docs" / "benchmarks.md"):
        named |= set(re.findall(r"benchmarks/(\w+\.py)", doc.read_text()))
    missing = sorted(named - listed - set(run_all.NOT_BENCHMARKS))
    assert not missing, f"benchmarks/run_all.py does not run {missing}, which the docs quote"
    for bench in run_all.BENCHMARKS:
        assert bench.full, bench.name
        assert bench.quick or bench.why_not_quick, f"{bench.name}: no quick run and no reason"
        for command in (*bench.full, *bench.quick):
            script = command[0]
            assert script == "-m" or (REPO / script).is_file(), f"{bench.name}: {script} does not exist"


def test_the_list_says_what_quick_leaves_out():
    out = subprocess.run([sys.executable, "benchmarks/run_all.py", "--list", "--quick"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    run_all = _run_all()
    for bench in run_all.BENCHMARKS:
        assert f"{bench.name}: " in out.stdout
        if not bench.quick:
            assert f"(not in --quick: {bench.why_not_quick})" in out.stdout


def test_a_quick_run_prints_each_table_under_the_environment_line():
    out = subprocess.run([sys.executable, "benchmarks/run_all.py", "--quick", "--only", "dispatch"], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    environment = re.compile(r"^\S+Z  load [\d.]+ [\d.]+ [\d.]+  commit \S+  torch \S+  jax \S+  os.cpu_count\(\) \d+",
                             re.M)
    assert len(environment.findall(text)) >= 3, text  # the run's, the benchmark's, the summary's
    assert "$ benchmarks/dispatch.py --rounds 1 --ops 100" in text
    assert re.search(r"^x \+ y\s+[\d.]+ us\s+[\d.]+ us\s+[\d.]+ us\s+[\d.]+x\s+[\d.]+ us$", text, re.M), text
    assert re.search(r"^dispatch\s+ok\s", text, re.M), text
