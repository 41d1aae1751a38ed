"""The installed package's requirements: the torch releases users run today, and the `tpu` extra resolving
from the package index."""

from __future__ import annotations

import importlib.metadata
import os
import socket
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]


def _requirement(name: str, extra: str | None = None) -> Requirement:
    for line in importlib.metadata.requires("tpu-agent") or []:
        req = Requirement(line)
        if req.name != name:
            continue
        env = {"extra": extra or ""}
        if req.marker is None and extra is None or req.marker is not None and req.marker.evaluate(env):
            return req
    raise AssertionError(f"tpu-agent's installed metadata names no {name} requirement (extra {extra})")


@pytest.mark.parametrize("version", ["2.13.0", "2.14.1", "2.15.0"])
def test_torch_requirement_admits_current_releases(version):
    req = _requirement("torch")
    assert req.specifier.contains(Version(version), prereleases=False), f"torch {version} refused by {req}"


def test_torch_requirement_stops_before_an_unchecked_release():
    assert not _requirement("torch").specifier.contains(Version("2.16.0"))


def test_jax_floor_has_shard_map():
    """The floor is the oldest JAX the suite has passed with; the installed one satisfies it."""
    req = _requirement("jax")
    assert req.specifier.contains(Version(importlib.metadata.version("jax")))
    assert not req.specifier.contains(Version("0.4.35"))  # no jax.shard_map(check_vma=...) there


@pytest.mark.parametrize("extra, package", [("tpu", "jax[tpu]"), ("cuda12", "jax[cuda12]")])
def test_accelerator_extras(extra, package):
    req = _requirement("jax", extra)
    assert req.extras == {package.split("[")[1][:-1]}


def _index_reachable() -> str | None:
    """None when pip's index answers on its port, else why not."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    url = os.environ.get("PIP_INDEX_URL") or next(
        (line.split("=", 1)[1].strip("'\"") for line in out.splitlines() if line.split("=")[0].endswith("index-url")
         and "extra" not in line.split("=")[0]), "https://pypi.org/simple")
    host = urlparse(url).hostname or "pypi.org"
    try:
        socket.create_connection((host, 443), timeout=5).close()
    except OSError as exc:
        return f"package index {host} unreachable from this machine ({exc}): pip cannot resolve tpu-agent[tpu] here"
    return None


def test_tpu_extra_resolves_from_the_index():
    """`pip install --dry-run .[tpu]` resolves JAX with libtpu (needs the package index: CI reaches it)."""
    why = _index_reachable()
    if why:
        pytest.skip(why)
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-build-isolation",
                             "--disable-pip-version-check", f"{ROOT}[tpu]"], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "libtpu" in result.stdout, result.stdout[-3000:]
