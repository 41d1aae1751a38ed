"""Which of a host's devices each local rank owns: the environment a rank sets before JAX starts its backends.

A host runs its ranks one of two ways. One process over all chips (`tpu-agent run`, LOCAL_WORLD_SIZE 1): the
process sees every local device and nothing here applies. One process per chip, or per group of chips
(`torchrun --nproc-per-node N`, `tpu-agent run --nproc N`): local rank r must open only its own share, since
libtpu lets one process own a chip and a GPU process preallocates most of every GPU it sees.

- TPU: what PyTorch/XLA's PJRT launcher sets (torch_xla/_internal/tpu.py, `configure_topology`):
  TPU_VISIBLE_CHIPS, TPU_CHIPS_PER_PROCESS_BOUNDS, TPU_PROCESS_BOUNDS, TPU_PROCESS_ADDRESSES, TPU_PROCESS_PORT
  and CLOUD_TPU_TASK_ID, from the host's chip bounds (the VM's `tpu-env` metadata, or the accelerator type's
  known host shape). With one chip per process the values are PyTorch/XLA's; with several chips per process
  the host's bounds are split along y, then x (chip ids are numbered x fastest, so each share is a contiguous
  block of ids, as JAX's own multi-process tests hand out).
- GPU: `local_device_ids` for `jax.distributed.initialize` (JAX then restricts CUDA to them); where ranks share
  a GPU, no preallocation (XLA_PYTHON_CLIENT_PREALLOCATE=false).
- CPU: each process has its own simulated devices (`TPU_AGENT_DEVICES=N`, jax_setup.configure_environment).

Pure functions of their arguments, and `host_facts` reads the machine (no JAX import: this runs before it).
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass
from pathlib import Path

BASE_PORT = 8476  # PyTorch/XLA's base_port: local rank r's TPU runtime listens on BASE_PORT + r
GOOGLE_PCI_VENDOR = "0x1ae0"
TPU_PCI_DEVICES = frozenset({"0x0027", "0x005e", "0x0063", "0x006f", "0x0076"})  # v2/v3, v4, v5e, v6e, 7x
METADATA_URL = "http://metadata.google.internal/computeMetadata/v1/instance/attributes/"
_TYPE = re.compile(r"^(v2|v3|v4|v5p|v5e|v5litepod|v6e|tpu7x)-(\d+)$")
# Families whose accelerator-type suffix counts TensorCores (two per chip), not chips.
_CORES_IN_NAME = frozenset({"v2", "v3", "v4", "v5p", "tpu7x"})


@dataclass(frozen=True)
class TpuHost:
    """One TPU VM of a slice."""

    accelerator_type: str
    chips_per_host_bounds: tuple[int, int, int]  # the host's chips as an x, y, z block
    host_bounds: tuple[int, int, int]  # the slice's hosts as an x, y, z block
    worker_id: int = 0  # this host's index in the slice
    worker_ips: tuple[str, ...] = ("localhost",)

    @property
    def chips(self) -> int:
        x, y, z = self.chips_per_host_bounds
        return x * y * z


def _bounds(text: str) -> tuple[int, int, int]:
    dims = tuple(int(d) for d in str(text).split(","))
    if len(dims) != 3 or min(dims) < 1:
        raise ValueError(f"TPU bounds {text!r} should be three positive integers (x,y,z)")
    return dims  # type: ignore[return-value]


def _text(bounds) -> str:
    return ",".join(str(d) for d in bounds)


def family(accelerator_type: str) -> str:
    """`v5e` for v5litepod-8 and v5e-8, `v4` for v4-8, ...; ValueError for a type this does not know."""
    match = _TYPE.match(accelerator_type.strip().lower())
    if not match:
        raise ValueError(f"unknown TPU accelerator type {accelerator_type!r} (expected e.g. v4-8, v5litepod-8, "
                         "v5p-8, v6e-8)")
    name = match.group(1)
    return "v5e" if name == "v5litepod" else name


def slice_chips(accelerator_type: str) -> int:
    size = int(accelerator_type.rpartition("-")[2])
    return size // 2 if family(accelerator_type) in _CORES_IN_NAME else size


def default_chips_per_host_bounds(accelerator_type: str) -> tuple[int, int, int]:
    """The host shape a VM of this type has, where its metadata does not say: 4 chips (2x2) per host, except
    single-host v5e and v6e slices of 1 or 8 chips (1x1, 2x4)."""
    chips = slice_chips(accelerator_type)
    if family(accelerator_type) in ("v5e", "v6e") and chips <= 8:
        return {1: (1, 1, 1), 4: (2, 2, 1), 8: (2, 4, 1)}.get(chips) or _unknown(accelerator_type)
    if chips < 4:
        return _unknown(accelerator_type)
    return (2, 2, 1)


def _unknown(accelerator_type: str):
    raise ValueError(f"no known host shape for {accelerator_type!r}; set TPU_CHIPS_PER_HOST_BOUNDS")


def tpu_host(accelerator_type: str, worker_id: int = 0, worker_ips=("localhost",), chips_per_host_bounds=None,
             host_bounds=None) -> TpuHost:
    chips = _bounds(chips_per_host_bounds) if chips_per_host_bounds else default_chips_per_host_bounds(
        accelerator_type)
    hosts = max(1, slice_chips(accelerator_type) // (chips[0] * chips[1] * chips[2]))
    if host_bounds:
        bounds = _bounds(host_bounds)
    elif hosts == 1:
        bounds = (1, 1, 1)
    else:
        raise ValueError(f"{accelerator_type} spans {hosts} hosts: set TPU_HOST_BOUNDS (the VM's tpu-env metadata "
                         "has it)")
    ips = tuple(worker_ips) if worker_ips and len(tuple(worker_ips)) > 1 else ("localhost",)
    return TpuHost(accelerator_type, chips, bounds, worker_id, ips)


def chips_per_process_bounds(host: TpuHost, local_world_size: int) -> tuple[int, int, int]:
    """Each local process's block of chips: the host's bounds divided by the process count, along y then x."""
    x, y, z = host.chips_per_host_bounds
    n = local_world_size
    if n < 1 or host.chips % n:
        raise ValueError(f"{n} processes cannot share the {host.chips} chips of a {host.accelerator_type} host "
                         "evenly")
    for dim in (1, 0, 2):
        dims = [x, y, z]
        k = min(n, dims[dim])
        while dims[dim] % k or n % k:
            k -= 1
        dims[dim] //= k
        x, y, z = dims
        n //= k
    if n != 1:
        raise ValueError(f"{local_world_size} processes cannot split a {_text(host.chips_per_host_bounds)} host "
                         "into equal blocks")
    return x, y, z


def tpu_environment(host: TpuHost, local_rank: int, local_world_size: int, base_port: int = BASE_PORT) -> dict:
    """The variables local rank `local_rank` of `local_world_size` on `host` sets before libtpu starts."""
    if not 0 <= local_rank < local_world_size:
        raise ValueError(f"local rank {local_rank} outside a host of {local_world_size} processes")
    per_process = chips_per_process_bounds(host, local_world_size)
    split = tuple(h // p for h, p in zip(host.chips_per_host_bounds, per_process))
    process_bounds = _text(b * s for b, s in zip(host.host_bounds, split))
    if family(host.accelerator_type) == "tpu7x":
        process_bounds += ",2"  # as PyTorch/XLA does for TPU v7
    chips = per_process[0] * per_process[1] * per_process[2]
    first = local_rank * chips
    ports = range(base_port, base_port + local_world_size)
    return {
        "TPU_CHIPS_PER_PROCESS_BOUNDS": _text(per_process),
        "TPU_PROCESS_BOUNDS": process_bounds,
        "CLOUD_TPU_TASK_ID": str(host.worker_id * local_world_size + local_rank),
        "TPU_PROCESS_ADDRESSES": ",".join(f"{ip}:{port}" for ip in host.worker_ips for port in ports),
        "TPU_PROCESS_PORT": str(base_port + local_rank),
        "TPU_VISIBLE_CHIPS": ",".join(str(c) for c in range(first, first + chips)),
    }


def gpu_share(local_rank: int, local_world_size: int, gpus: int) -> tuple[list[int], dict]:
    """(local_device_ids, environment) of a rank on a host of `gpus` GPUs: its contiguous share, or where there
    are more ranks than GPUs, the GPU it shares, without preallocating it."""
    if gpus < 1:
        return [], {}
    if local_world_size <= gpus:
        each = gpus // local_world_size
        return list(range(local_rank * each, (local_rank + 1) * each)), {}
    return [local_rank % gpus], {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}


# --- the machine (read once, before JAX) ------------------------------------------------------------------------
def tpu_chips_on_pci() -> int:
    """TPU chips attached to this host (PCI vendor and device ids, as PyTorch/XLA counts them)."""
    count = 0
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            if Path(vendor).read_text().strip() != GOOGLE_PCI_VENDOR:
                continue
            if (Path(vendor).parent / "device").read_text().strip() in TPU_PCI_DEVICES:
                count += 1
        except OSError:
            continue
    return count


def _metadata(key: str) -> str | None:
    import urllib.request

    request = urllib.request.Request(METADATA_URL + key, headers={"Metadata-Flavor": "Google"})
    try:
        with urllib.request.urlopen(request, timeout=2) as response:
            return response.read().decode()
    except OSError:
        return None


def parse_tpu_env(text: str) -> dict:
    """A VM's `tpu-env` metadata (YAML lines `KEY: 'value'`) as the TPU_* variables that say the same."""
    facts = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip().strip("'\"")
        if key == "ACCELERATOR_TYPE":
            facts["TPU_ACCELERATOR_TYPE"] = value
        elif key in ("CHIPS_PER_HOST_BOUNDS", "HOST_BOUNDS", "WORKER_ID"):
            facts[f"TPU_{key}"] = value
    return facts


def tpu_host_from_facts(facts: dict) -> TpuHost | None:
    if not facts.get("TPU_ACCELERATOR_TYPE"):
        return None
    ips = tuple(ip for ip in facts.get("TPU_WORKER_HOSTNAMES", "").split(",") if ip) or ("localhost",)
    return tpu_host(facts["TPU_ACCELERATOR_TYPE"], int(facts.get("TPU_WORKER_ID") or 0), ips,
                    facts.get("TPU_CHIPS_PER_HOST_BOUNDS"), facts.get("TPU_HOST_BOUNDS"))


def tpu_host_from_machine(environ=os.environ) -> TpuHost | None:
    """This VM's TpuHost from TPU_* variables, else the VM's `tpu-env` metadata; None where neither says."""
    names = ("TPU_ACCELERATOR_TYPE", "TPU_CHIPS_PER_HOST_BOUNDS", "TPU_HOST_BOUNDS", "TPU_WORKER_ID",
             "TPU_WORKER_HOSTNAMES")
    facts = {k: environ[k] for k in names if environ.get(k)}
    if "TPU_ACCELERATOR_TYPE" not in facts:
        facts = {**parse_tpu_env(_metadata("tpu-env") or ""), **facts}
        endpoints = _metadata("worker-network-endpoints")
        if endpoints and "TPU_WORKER_HOSTNAMES" not in facts:  # hostname:uid:ip,...
            facts["TPU_WORKER_HOSTNAMES"] = ",".join(w.split(":")[2] for w in endpoints.split(",") if w.count(":") >= 2)
    return tpu_host_from_facts(facts)


def gpus_on_machine(environ=os.environ) -> int:
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([v for v in visible.split(",") if v.strip() and v.strip() != "-1"])
    return len([p for p in glob.glob("/dev/nvidia*") if re.fullmatch(r"/dev/nvidia\d+", p)])


def platform(environ=os.environ) -> str:
    """`tpu`, `gpu` or `cpu`: the platform JAX will pick, told from the machine without starting JAX."""
    asked = (environ.get("JAX_PLATFORMS") or environ.get("JAX_PLATFORM_NAME") or "").split(",")[0].strip().lower()
    if asked in ("cpu", "tpu"):
        return asked
    if asked in ("cuda", "gpu", "rocm"):
        return "gpu"
    if tpu_chips_on_pci():
        return "tpu"
    if gpus_on_machine(environ):
        return "gpu"
    return "cpu"


@dataclass(frozen=True)
class RankShare:
    platform: str
    environment: dict  # variables to set where the user has not (setdefault)
    local_device_ids: list | None  # for jax.distributed.initialize (GPU)


def rank_share(environ=os.environ) -> RankShare | None:
    """This rank's share of the host, or None outside a launcher's job of several local processes."""
    try:
        local_rank = int(environ.get("LOCAL_RANK", ""))
        local_world = int(environ.get("LOCAL_WORLD_SIZE", ""))
    except ValueError:
        return None
    if local_world < 2:
        return None
    kind = platform(environ)
    if kind == "tpu":
        try:
            host = tpu_host_from_machine(environ)
            if host is None:
                return RankShare(kind, {}, None)
            return RankShare(kind, tpu_environment(host, local_rank, local_world), None)
        except ValueError as exc:  # a host shape this does not know, or chips that do not split evenly
            import warnings

            warnings.warn(f"tpu-agent: {exc}; local rank {local_rank} is left to open the chips libtpu gives it",
                          stacklevel=2)
            return RankShare(kind, {}, None)
    if kind == "gpu":
        ids, env = gpu_share(local_rank, local_world, gpus_on_machine(environ))
        return RankShare(kind, env, ids or None)
    return RankShare(kind, {}, None)
