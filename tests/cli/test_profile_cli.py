"""`tpu-agent profile` end to end: the installed CLI on examples and small scripts, in subprocesses."""

from __future__ import annotations

import gzip
import json
import os
import pty
import subprocess
import textwrap
from pathlib import Path

import pytest

from support.paths import EXAMPLES, TPU_AGENT
from support.processes import clean_env, one_error_line, run_tool
from tpu_agent.profilers.schema import Profile


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One real CPU calibration for the whole session, in a private cache."""
    import jax

    from tpu_agent.profilers import peaks

    path = tmp_path_factory.mktemp("cache")
    old = os.environ.get("TPU_AGENT_CACHE_DIR")
    os.environ["TPU_AGENT_CACHE_DIR"] = str(path)
    try:
        device = jax.devices()[0]
        peaks.device_peak(device.platform, device.device_kind, 1)
    finally:
        if old is None:
            del os.environ["TPU_AGENT_CACHE_DIR"]
        else:
            os.environ["TPU_AGENT_CACHE_DIR"] = old
    return path


def profile(*args: str, cwd: Path, cache: Path, timeout: float = 240):
    return run_tool("profile", *args, cwd=cwd, env=clean_env(TPU_AGENT_CACHE_DIR=str(cache)), timeout=timeout)


def load(run_dir: Path) -> Profile:
    return Profile.model_validate_json((run_dir / "profile.json").read_text())


def only_run_dir(cwd: Path) -> Path:
    (run_dir,) = (cwd / ".tpu-agent" / "runs").iterdir()
    return run_dir


def write(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


TRAIN = """\
    import sys
    import torch
    model = torch.nn.Linear(8, 4).to("tpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(16, 8).to("tpu")
    for i in range({steps}):
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        {after}
"""


def test_odd_shapes_json_profile(tmp_path, cache_dir):
    proc = profile(str(EXAMPLES / "odd_shapes.py"), "--steps", "3", "--target", "v5e", "--json",
                   cwd=tmp_path, cache=cache_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # --json: stdout is the profile alone; the script's own output went to stderr.
    prof = Profile.model_validate_json(proc.stdout)
    # Step 7 (3 measured after 2 warm-up, then 2 timed for the host/device split) is stopped at its boundary,
    # inside optimizer.step(): before the script prints it.
    assert proc.stderr.count("step=") == 6 and "step=" not in proc.stdout
    run_dir = only_run_dir(tmp_path)
    assert load(run_dir) == prof
    assert json.loads((run_dir / "run.json").read_text())["exit_code"] == 0

    assert prof.status == "stopped" and prof.steps.stopped_by_profiler
    assert [s.index for s in prof.steps.items] == [1, 2, 3, 4, 5, 6, 7]
    assert [s.warmup for s in prof.steps.items] == [True, True, False, False, False, False, False]
    assert [s.index for s in prof.steps.items if s.device_s is not None] == [6, 7]
    assert prof.steps.stats.count <= 3 and prof.host_device is not None
    assert prof.steps.markers == ["optimizer"] and prof.mode_used == "fused"
    assert prof.steps.stats is not None and prof.steps.stats.median_s > 0

    check = prof.flops.check
    # XLA's total leaves out the convolutions' multiply-adds against zero padding (FlopCounterMode counts them):
    # given back, the totals agree; dots and convolutions counted from the HLO agree exactly.
    assert check.agrees and abs(check.adjusted_relative_difference) <= 0.10, check
    assert check.xla_conv_padding_flops > 0 and "zero padding" in check.explanation, check
    assert check.dot_conv_agrees and abs(check.dot_conv_relative_difference) <= 0.01, check
    assert prof.flops.per_step == pytest.approx(check.xla_flops, rel=0.05)
    assert prof.flops.peak.measured and prof.flops.mfu > 0
    # The one-off sizes (batch, channels, hidden width), each with its padded size and its waste.
    dims = {d.size: d for d in prof.padding.dims}
    assert {50, 63, 127, 255} <= set(dims)
    assert [dims[s].padded_to for s in (50, 63, 127, 255)] == [128, 128, 128, 256]
    assert all(dims[s].wasted_flops_per_step.value > 0 for s in (50, 63, 127, 255))
    top = prof.hot_ops[0]
    assert top.opcode in ("convolution", "fusion") and top.source.startswith("odd_shapes.py:")
    assert top.aten_op == "aten.convolution.default"
    assert prof.target.estimate and prof.target.step_s.value > 0

    hlo_files = list((run_dir / "hlo").glob("*.hlo.txt"))
    assert hlo_files and all(e.hlo_file for e in prof.executables)
    assert any("dot(" in f.read_text() for f in hlo_files)
    assert (run_dir / "step_times.png").read_bytes()[:4] == b"\x89PNG"


def test_transformer_names_the_vocabulary(tmp_path, cache_dir):
    # One step measured after the one warm-up step (the least --warmup takes): enough for the FLOPs and the padding
    # report, and fast.
    proc = profile(str(EXAMPLES / "transformer.py"), "--steps", "1", "--warmup", "1", cwd=tmp_path, cache=cache_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "profile transformer.py" in out and "agree within 10%" in out
    assert "padding waste on TPU v5e" in out and "(estimate)" in out
    prof = load(only_run_dir(tmp_path))
    assert prof.flops.check.agrees
    vocab = next(d for d in prof.padding.dims if d.size == 50257)
    assert vocab.padded_to == 50304 and vocab.wasted_flops_per_step.value > 0
    assert any("transformer.py:" in op for op in vocab.ops)
    assert "50257" in out


def test_a_failing_script_keeps_a_partial_profile(tmp_path, cache_dir):
    """A script that raises at its third step: its own traceback, exit 1, the profile of its steps (a sys.exit(3)
    at the third step: test_a_step_without_matmul_and_a_sys_exit_mid_run_keep_a_partial_profile)."""
    script = write(tmp_path, "crash.py", TRAIN.format(steps=5, after="if i == 2: raise ValueError('boom at step 3')"))
    proc = profile("crash.py", cwd=tmp_path, cache=cache_dir)
    assert proc.returncode == 1, proc.stderr[-3000:]
    # the script's own traceback, without our frames
    assert f'File "{script}", line 11, in <module>' in proc.stderr
    assert "tpu_agent" not in proc.stderr and "runpy" not in proc.stderr
    assert "the script failed (exit 1) after 3 steps" in proc.stdout
    run_dir = only_run_dir(tmp_path)
    prof = load(run_dir)
    assert (prof.status, prof.exit_code, prof.error) == ("failed", 1, "ValueError: boom at step 3")
    assert len(prof.steps.items) == 3 and prof.flops.per_step > 0
    assert json.loads((run_dir / "run.json").read_text())["exit_code"] == 1


def test_a_step_without_matmul_and_a_sys_exit_mid_run_keep_a_partial_profile(tmp_path, cache_dir):
    """FlopCounterMode counts 0 when no step has a matmul: no ratio (null), never inf, and the profile reads back;
    the script's sys.exit(3) after its third step is its exit code, with the profile of the steps it ran."""
    write(tmp_path, "nomm.py", """\
        import sys, torch
        p = torch.nn.Parameter(torch.ones(8, device="tpu"))
        opt = torch.optim.SGD([p], lr=0.1)
        for step in range(5):
            opt.zero_grad()
            (p.sin() ** 2).sum().backward()
            opt.step()
            if step == 2: sys.exit(3)
    """)
    proc = profile("nomm.py", "--warmup", "1", cwd=tmp_path, cache=cache_dir)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "error" not in proc.stderr and "no ratio" in proc.stdout
    assert "the script failed (exit 3) after 3 steps" in proc.stdout
    run_dir = only_run_dir(tmp_path)
    prof = load(run_dir)
    assert (prof.status, prof.exit_code, prof.error) == ("failed", 3, "SystemExit: 3")
    assert len(prof.steps.items) == 3
    assert prof.flops.check.flop_counter_flops == 0 and prof.flops.check.relative_difference is None
    assert prof.flops.per_step > 0
    assert json.loads((run_dir / "run.json").read_text())["exit_code"] == 3


def test_timeout_stops_a_hanging_script_with_exit_124(tmp_path):
    write(tmp_path, "hang.py", "import time\ntime.sleep(3600)\n")
    proc = run_tool("profile", "hang.py", "--timeout", "2", cwd=tmp_path, timeout=60)
    assert proc.returncode == 124, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("error: hang.py ran past --timeout 2 s and was stopped")


def test_script_without_steps_is_one_region(tmp_path, cache_dir):
    write(tmp_path, "nosteps.py", """\
        import torch
        a = torch.randn(64, 64).to("tpu")
        for _ in range(3):
            a = torch.tanh(a @ a)
        print(float(a.sum()))
    """)
    proc = profile("nosteps.py", "--steps", "5", "--mode", "compiled-if-available", cwd=tmp_path, cache=cache_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "note: no step markers: the whole run is one region" in proc.stdout
    prof = load(only_run_dir(tmp_path))
    assert prof.steps.whole_run and prof.steps.markers == [] and len(prof.steps.items) == 1
    assert prof.status == "complete"
    assert prof.flops.check.region == "the whole run (no step markers)" and prof.flops.check.agrees
    assert prof.flops.per_step == pytest.approx(3 * 2 * 64**3, rel=0.05)
    # compiled mode: used where the backend has it, else fused, said either way.
    assert prof.mode_used in ("fused", "compiled")
    assert any("compiled mode" in note for note in prof.notes)


def test_mark_step_eager_devices_trace_and_dumps(tmp_path, cache_dir):
    write(tmp_path, "marks.py", """\
        import torch
        w = torch.randn(100, 300).to("tpu")
        for _ in range(6):
            w = torch.relu(w @ torch.ones(300, 300, device="tpu")) / 300
            torch.tpu.mark_step()
    """)
    trace = tmp_path / "trace"
    proc = profile("marks.py", "--mode", "eager", "--devices", "2", "--steps", "2", "--warmup", "1",
                   "--trace", str(trace), "--xla-dump", "--no-dump-hlo", "--target", "v6e", cwd=tmp_path,
                   cache=cache_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = only_run_dir(tmp_path)
    prof = load(run_dir)
    assert prof.steps.markers == ["mark_step"] and len(prof.steps.items) == 5  # with 2 timed steps
    assert prof.mode_used == "eager" and prof.device.count == 2
    assert {e.kind for e in prof.executables} >= {"eager"}
    assert prof.target.generation == "v6e" and prof.padding.generation == "v6e"
    dims = {d.size: d for d in prof.padding.dims}
    assert dims[300].padded_to == 512 and dims[100].roles == ["M"]
    assert prof.files.hlo_dir is None and not (run_dir / "hlo").exists()
    assert any((run_dir / "xla_dump").iterdir())
    # Where XProf (and TensorBoard's profile plugin) look: <logdir>/plugins/profile/<run>/<host>.xplane.pb
    assert prof.files.trace_dir == str(trace)
    (run,) = (trace / "plugins" / "profile").iterdir()
    assert list(run.glob("*.xplane.pb")) and (run / "perfetto_trace.json.gz").exists()
    # the trace covers the measured steps (after the warm-up step), each one a step marker
    events = json.loads(gzip.decompress((run / "perfetto_trace.json.gz").read_bytes()))
    events = events["traceEvents"] if isinstance(events, dict) else events
    assert sorted(int(e["args"]["step_num"]) for e in events if e.get("name") == "train") == [2, 3]
    assert "open the trace: xprof --logdir trace  (or tensorboard --logdir trace" in proc.stdout  # relative to cwd


@pytest.mark.parametrize(("args", "message"), [
    (["ok.py", "--steps", "0"], "invalid value for '--steps'"),
    (["ok.py", "--warmup", "-1"], "invalid value for '--warmup'"),
    (["ok.py", "--mode", "turbo"], "invalid value for '--mode'"),
    (["ok.py", "--target", "v9"], "invalid value for '--target'"),
    (["ok.py", "-o", "afile/runs"], "cannot write the output directory afile/runs"),
    (["ok.py", "--trace", "afile/trace"], "cannot write the trace directory"),
    (["missing.py"], "script not found: missing.py"),
    (["bad.py"], "syntax error in bad.py line 1"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    (tmp_path / "ok.py").write_text("print('hi')\n")
    (tmp_path / "bad.py").write_text("def f(:\n")
    (tmp_path / "afile").write_text("")
    proc = run_tool("profile", *args, cwd=tmp_path)
    assert proc.returncode == 2
    assert message in one_error_line(proc)
    assert not (tmp_path / ".tpu-agent").exists()


def test_doctor_shows_the_calibration(tmp_path, cache_dir):
    cached = json.loads((cache_dir / "peaks.json").read_text())
    (entry,) = [v for k, v in cached.items() if k.endswith("|1 devices")]
    proc = run_tool("doctor", "--json", cwd=tmp_path, env=clean_env(TPU_AGENT_CACHE_DIR=str(cache_dir)))
    env = json.loads(proc.stdout)
    assert env["peak_flops_per_s"] == entry["flops_per_s"]
    assert "measured" in env["peak_source"]
    # Without a calibration the doctor says "not calibrated yet": tests/cli/test_cli.py::test_doctor_text, whose
    # cache directory is empty.


def test_progress_on_a_terminal_relays_the_scripts_output_and_a_stop_at_steps_runs_its_finally(tmp_path, cache_dir):
    """One profile on a terminal: the script's output shown above the progress bar, and stopped by --steps at a step
    boundary, the script's `finally` runs (an `except Exception` does not swallow the stop, the code after the
    loop never runs)."""
    write(tmp_path, "train.py", """\
        import torch
        model = torch.nn.Linear(8, 4).to("tpu")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(16, 8).to("tpu")
        try:
            for i in range(1000):
                opt.zero_grad()
                loss = model(x).square().mean()
                loss.backward()
                opt.step()
                print(f'line {i}')
        except Exception:
            print("swallowed")
        finally:
            print("finally ran")
        print("after the loop")
    """)
    leader, follower = pty.openpty()
    proc = subprocess.Popen([str(TPU_AGENT), "profile", "train.py", "--steps", "2", "--warmup", "1"], cwd=tmp_path,
                            env=clean_env(TPU_AGENT_CACHE_DIR=str(cache_dir), COLUMNS="120"),
                            stdin=subprocess.DEVNULL, stdout=follower, stderr=follower)
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 65536)
        except OSError:  # EIO: the terminal's other side is closed
            break
        if not data:
            break
        chunks.append(data)
    assert proc.wait(timeout=120) == 0
    os.close(leader)
    text = b"".join(chunks).decode(errors="replace")
    assert "line 0" in text and "line 1" in text  # the script's output, shown above the bar
    assert "profiling train.py" in text  # the progress bar
    assert "stopped by --steps after 5 steps" in text  # 1 warm-up, 2 measured, 2 timed (host/device)
    assert "finally ran" in text
    assert "swallowed" not in text and "after the loop" not in text
    prof = load(only_run_dir(tmp_path))
    assert prof.status == "stopped" and len(prof.steps.items) == 5  # 1 warm-up, 2 measured, 2 timed


def test_compiled_steps_are_reported_as_compiled(tmp_path, cache_dir):
    import torch

    write(tmp_path, "compiled.py", """\
        import torch
        model = torch.nn.Linear(8, 4).to("tpu")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(16, 8).to("tpu")

        @torch.compile
        def step(x):
            opt.zero_grad()
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            return loss

        for _ in range(6):
            step(x)
    """)
    proc = profile("compiled.py", "--mode", "compiled-if-available", "--steps", "2", cwd=tmp_path, cache=cache_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    prof = load(only_run_dir(tmp_path))
    if callable(getattr(torch.tpu, "compile", None)):
        assert prof.mode_used == "compiled" and "compiled mode" in proc.stdout
    else:
        assert prof.mode_used == "fused" and "profiled in fused mode" in proc.stdout
    assert prof.status == "stopped" and len(prof.steps.items) == 6  # with 2 timed steps
