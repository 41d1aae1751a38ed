"""`--device-map cuda=tpu`: a script written for CUDA runs on tpu unedited; without it, a run that never touched
tpu says so (run) or shows no device figures (profile, knobs, tune)."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest

from support.processes import one_error_line, run_python, run_tool
from tpu_agent.errors import InputError
from tpu_agent.run.device_map import parse

# The usual shape: CUDA when there is one, else the CPU. Data made on the CPU (each device has its own RNG).
CUDA_WHEN_AVAILABLE = """\
import sys
import torch
import torch.nn as nn

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
data = torch.utils.data.TensorDataset(torch.randn(64, 16), torch.randint(0, 4, (64,)))
loader = torch.utils.data.DataLoader(data, batch_size=16, pin_memory=True)  # as CUDA scripts load
for step, (xb, yb) in enumerate(loader):
    xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
    loss = nn.functional.cross_entropy(model(xb), yb)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    print(f"step={step} loss={loss.item():.6f}")
print(f"device={next(model.parameters()).device.type}")
sys.exit({code})
"""

STEP = re.compile(r"^step=\d+ loss=(\S+)$", re.M)


def write(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def losses(stdout: str) -> list[float]:
    return [float(v) for v in STEP.findall(stdout)]


@pytest.mark.parametrize("text", ["cuda=tpu", " CUDA = tpu "])
def test_cuda_to_tpu_parses(text):
    mapping = parse(text)
    assert (mapping.source, mapping.target, mapping.spelled()) == ("cuda", "tpu", "cuda=tpu")


@pytest.mark.parametrize(("text", "message"), [
    ("cuda", "expected FROM=TO"), ("=tpu", "expected FROM=TO"), ("cuda=", "expected FROM=TO"),
    ("cuda=xpu", "only cuda=tpu is supported"), ("mps=tpu", "only cuda=tpu is supported"),
])
def test_anything_else_is_refused(text, message):
    with pytest.raises(InputError, match=message):
        parse(text)


@pytest.mark.parametrize("command", ["run", "profile", "tune"])
def test_an_unsupported_map_is_one_line_and_exit_2(tmp_path, command):
    write(tmp_path, "train.py", "print('never runs')\n")
    proc = run_tool(command, "--device-map", "cuda=xpu", "train.py", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert one_error_line(proc) == "error: --device-map 'cuda=xpu': only cuda=tpu is supported"
    assert not (tmp_path / ".tpu-agent").exists()  # refused before anything ran


# Calls that fail without CUDA (`.cuda()`, device="cuda", CUDA autocast and GradScaler, torch.load onto cuda,
# torch.cuda's functions, TF32 flags): run after the training loop where CUDA is available (under the map), each
# result printed on a line of its own.
CUDA_ONLY = """\
assert torch.cuda.is_available() and torch.cuda.device_count() >= 1
torch.backends.cuda.matmul.allow_tf32 = True
torch.backends.cudnn.benchmark = True
torch.cuda.manual_seed_all(0)
torch.cuda.set_device(0)
dev = torch.device("cuda")
model = torch.nn.Linear(4, 2).cuda()
a = torch.ones(3, 4).to("cuda:0")
b = torch.zeros(3, 4, device="cuda")
c = torch.ones(3, 4).to(dev, non_blocking=True)
d = torch.ones(2).cuda(0)
with torch.autocast("cuda", dtype=torch.bfloat16):
    low = model(a)
scaler = torch.amp.GradScaler("cuda")
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler.scale(model(a + b + c).sum()).backward()
scaler.step(opt)
scaler.update()
torch.cuda.synchronize()
torch.save(model.state_dict(), "m.pt")
loaded = torch.load("m.pt", map_location="cuda")
print("devices", sorted({str(t.device) for t in (model.weight, a, b, c, d, loaded["weight"])}), dev.type)
print("autocast", low.dtype, "scaler", scaler._device, scaler.get_scale())
from tpu_agent.backend.core import modes
print("is_cuda", a.is_cuda, "precision", modes.current_precision().name)
print("memory", torch.cuda.memory_allocated() > 0, torch.cuda.get_device_name(0).startswith("TPU"))
"""


def _with_cuda_only_calls(script: str) -> str:
    """The script with CUDA_ONLY run before its exit where CUDA is available (the training above it as written)."""
    body = textwrap.indent(CUDA_ONLY, "    ")
    return script.replace("sys.exit(", f"if torch.cuda.is_available():\n{body}sys.exit(", 1)


@pytest.mark.slow
def test_a_cuda_script_trains_on_tpu_with_its_cpu_losses_its_cuda_only_calls_run_there_and_without_the_map_warns(
        tmp_path):
    """One CPU reference (plain python, exit code 3) for both: under --device-map cuda=tpu the script trains on tpu
    with the CPU's losses, the map said in one line at the start, and no warning, and after its training, the calls
    that fail without CUDA (CUDA_ONLY: `.cuda()`, device="cuda", CUDA autocast and GradScaler, torch.load onto cuda,
    torch.cuda's functions, TF32 flags) all land on tpu, in the same run; without the map, nothing reached tpu: the
    run warns and keeps the script's stdout and exit code, and a script that insists on CUDA gets PyTorch's own
    error, then the switch."""
    write(tmp_path, "train.py", _with_cuda_only_calls(CUDA_WHEN_AVAILABLE.replace("{code}", "3")))
    plain = run_python("train.py", cwd=tmp_path)
    assert plain.returncode == 3, plain.stderr
    assert "device=cpu" in plain.stdout  # no CUDA here: plain python trains on the CPU

    mapped = run_tool("run", "--device-map", "cuda=tpu", "train.py", cwd=tmp_path)
    assert mapped.returncode == 3, mapped.stderr
    assert "device=tpu" in mapped.stdout
    expected, got = losses(plain.stdout), losses(mapped.stdout)
    assert len(expected) == 4 and got == pytest.approx(expected, rel=1e-4)
    lines = mapped.stdout.splitlines()
    lines = lines[lines.index("device=tpu") + 1:]  # the CUDA-only calls' lines, after the training's
    assert lines[0] == "devices ['tpu:0'] tpu"
    assert lines[1] == "autocast torch.bfloat16 scaler tpu 65536.0"
    assert lines[2] == "is_cuda True precision HIGH"  # TF32 allowed: three bf16 passes, as TF32 is to f32
    assert lines[3] == "memory True True"
    said = [line for line in mapped.stderr.splitlines() if "--device-map" in line]
    assert said == [mapped.stderr.splitlines()[0]] and "run on tpu" in said[0]  # one line, at the start
    assert "warning" not in mapped.stderr

    ours = run_tool("run", "-q", "train.py", cwd=tmp_path)
    assert ours.returncode == 3
    assert ours.stdout == plain.stdout
    last = ours.stderr.strip().splitlines()[-1]
    assert last.startswith("tpu-agent: warning: the model trained on the CPU: no op of this run ran on the tpu device")
    assert "--device-map cuda=tpu" in last and '.to("tpu")' in last
    # A run whose ops reached tpu does not warn: the mapped run above (the warning reads the device's own op and
    # copy counters, whatever put the work there: the map or a script's own .to("tpu")).
    write(tmp_path, "no_model.py", "import torch\nprint(torch.ones(2).sum().item())\n")  # nothing trained: no news
    quiet = run_tool("run", "-q", "no_model.py", cwd=tmp_path)
    assert (quiet.returncode, quiet.stdout, quiet.stderr) == (0, "2.0\n", "")
    write(tmp_path, "insists.py", "import torch\nmodel = torch.nn.Linear(4, 2).cuda()\n")
    without = run_tool("run", "-q", "insists.py", cwd=tmp_path)  # unmapped: PyTorch's own error, then the switch
    assert without.returncode == 1
    lines = without.stderr.strip().splitlines()
    assert lines[-2] == "AssertionError: Torch not compiled with CUDA enabled"
    assert lines[-1] == "tpu-agent: the script asks for CUDA: run it on tpu unedited with --device-map cuda=tpu"


@pytest.mark.slow
def test_profile_and_knobs_refuse_device_figures_for_a_cpu_run(tmp_path):
    write(tmp_path, "train.py", CUDA_WHEN_AVAILABLE.replace("{code}", "0"))
    proc = run_tool("profile", "train.py", "--warmup", "1", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: no op of train.py ran on the tpu device, so there are no device figures to "
                           "profile; pass --device-map cuda=tpu"), last
    assert "MFU" not in proc.stdout and "FLOP" not in proc.stdout
    (run_dir,) = (tmp_path / ".tpu-agent" / "runs").iterdir()
    prof = json.loads((run_dir / "profile.json").read_text())
    assert prof["executables"] == []  # what the refusal read: nothing ran on the device
    knobs = run_tool("knobs", "train.py", "--profile", str(run_dir), cwd=tmp_path)
    assert knobs.returncode == 2
    assert "no op of train.py ran on the tpu device" in one_error_line(knobs)
    static = run_tool("knobs", "train.py", cwd=tmp_path)  # the newest profile is that one: not a ranking
    assert static.returncode == 0 and "the newest profile of this script ran no op on the tpu device" in static.stdout
    mapped = run_tool("profile", "--device-map", "cuda=tpu", "train.py", "--warmup", "1", cwd=tmp_path)
    assert mapped.returncode == 0, mapped.stderr
    assert "MFU" in mapped.stdout


@pytest.mark.slow
def test_tune_refuses_a_cpu_run(tmp_path):
    write(tmp_path, "train.py", CUDA_WHEN_AVAILABLE.replace("{code}", "0").replace("batch_size=16", "batch_size=8"))
    proc = run_tool("tune", "train.py", "--trials", "1", "--steps", "5", "--warmup", "1", "--offline",
                    cwd=tmp_path, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: no op of train.py ran on the tpu device, so there are no device figures to "
                           "tune; pass --device-map cuda=tpu"), last


def test_tune_hands_the_map_to_every_child_and_takes_it_back(tmp_path, monkeypatch):
    """The baseline, the trials and the verification are children of the tune's process: each inherits the map."""
    from tpu_agent import envvars, pipeline
    from tpu_agent.cli.tune import tune

    seen = {}

    class Stop(Exception):
        pass

    def fake_tune(script, args, options, **_):
        seen["map"] = envvars.DEVICE_MAP.get()
        raise Stop

    monkeypatch.delenv(envvars.DEVICE_MAP.name, raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(pipeline, "tune", fake_tune)
    write(tmp_path, "train.py", "print('never runs')\n")
    with pytest.raises(Stop):
        tune("train.py", offline=True, device_map="CUDA=tpu")
    assert seen == {"map": "cuda=tpu"}
    assert envvars.DEVICE_MAP.get() is None
