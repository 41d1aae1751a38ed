"""Defaults for `tpu-agent tune` from `[tool.tpu-agent]` in the user's pyproject.toml; flags win.

The table is looked for from the script's directory upward: the nearest
pyproject.toml that has a `[tool.tpu-agent]` table is used (a monorepo's
package may have a pyproject.toml without one). Keys are the flags' long
names (`min-gain = 0.05`; `min_gain` is read the same). An unknown key, a
wrong type or a bad TOML file is an InputError (exit 2) naming the file and key,
so a typo is never silently ignored.

    [tool.tpu-agent]
    trials = 40
    target = "v5e"
    objective = "both"
    min-gain = 0.05
    storage = "postgresql://optuna@db/studies"
"""

from __future__ import annotations

import difflib
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tpu_agent.errors import InputError

TABLE = "tpu-agent"

Target = Literal["cpu", "v4", "v5e", "v5p", "v6e", "v7x"]
Objective = Literal["time", "memory", "both"]


class TuneOptions(BaseModel):
    """Every `tune` option, with its default. A field here is a key in [tool.tpu-agent] and a flag."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)  # trials = "20" is a typo to report

    trials: int = Field(20, ge=1, description="trials to run (measured configurations)")
    timeout: float | None = Field(None, gt=0, description="stop starting trials after this many seconds")
    trial_timeout: float = Field(600.0, gt=0, description="a trial running longer is stopped and recorded as failed")
    steps: int = Field(10, ge=1, description="measured steps per trial, after warm-up")
    warmup: int = Field(2, ge=0, description="first steps of a run left out of timings (compilation)")
    pairs: int = Field(5, ge=5, description="interleaved baseline/candidate pairs when verifying a gain")
    target: Target = Field("cpu", description="what to tune for: this machine, or a TPU generation (cost model)")
    objective: Objective = Field("time", description="step time, peak memory, or both")
    devices: int = Field(1, ge=1, description="simulated devices on a CPU")
    seed: int = Field(0, description="seed of the sampler and of the bootstrap")
    study: str | None = Field(None, description="Optuna study name (default: from the script)")
    storage: str | None = Field(None, description="Optuna storage URL (default: SQLite under .tpu-agent/)")
    resume: bool = Field(False, description="continue the study instead of starting a new one")
    min_gain: float = Field(0.03, ge=0, lt=1, description="a speedup is kept when its CI's lower end exceeds 1 + this")
    loss_tol: float = Field(0.02, ge=0, lt=1, description="a shape-changing plan may end with a loss this much worse")
    apply: bool = Field(False, description="write the verified changes into the user's files (with a backup)")
    force: bool = Field(False, description="with apply: overwrite files that have uncommitted changes")
    output_dir: str | None = Field(None, description="where run directories go (default ./.tpu-agent/runs)")
    playbooks: list[str] = Field(default_factory=list, description="extra playbook directories")
    proposer: Literal["auto", "offline", "claude"] = Field("auto", description="auto: claude when ANTHROPIC_API_KEY is set")
    model: str | None = Field(None, description="Claude model for the claude proposer")
    rounds: int = Field(1, ge=1, description="propose-search rounds (the claude proposer sees earlier results)")
    token_budget: int = Field(200_000, ge=1000, description="Claude tokens for the whole tune")


KEYS = {name.replace("_", "-"): name for name in TuneOptions.model_fields}


class ResolvedOptions(BaseModel):
    """The options a tune runs with, and where each came from (for the report)."""

    options: TuneOptions
    sources: dict[str, Literal["flag", "pyproject", "default"]]
    pyproject: str | None = Field(None, description="the pyproject.toml the defaults came from")


def find_pyproject(start: Path) -> tuple[Path, dict[str, Any]] | None:
    """The nearest pyproject.toml at or above `start` with a [tool.tpu-agent] table, and that table."""
    here = Path(start).resolve()
    if here.is_file():
        here = here.parent
    for directory in (here, *here.parents):
        candidate = directory / "pyproject.toml"
        if not candidate.is_file():
            continue
        try:
            data = tomllib.loads(candidate.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as exc:
            raise InputError(f"{candidate}: invalid TOML: {exc}") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise InputError(f"cannot read {candidate}: {getattr(exc, 'strerror', None) or exc}") from None
        table = data.get("tool", {}).get(TABLE) if isinstance(data.get("tool"), dict) else None
        if table is not None:
            if not isinstance(table, dict):
                raise InputError(f"{candidate}: [tool.{TABLE}] must be a table")
            return candidate, table
    return None


def _check_table(path: Path, table: dict[str, Any]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for key, value in table.items():
        name = KEYS.get(key.replace("_", "-"))
        if name is None:
            close = difflib.get_close_matches(key.replace("_", "-"), KEYS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f" (known keys: {', '.join(sorted(KEYS))})"
            raise InputError(f"{path}: unknown key {key!r} in [tool.{TABLE}]{hint}")
        if name in values:
            raise InputError(f"{path}: [tool.{TABLE}] sets {name.replace('_', '-')!r} twice")
        if isinstance(value, dict):
            raise InputError(f"{path}: [tool.{TABLE}] {key!r} must be a value, not a table")
        values[name] = value
    return values


def resolve(script: Path | str, flags: dict[str, Any] | None = None) -> ResolvedOptions:
    """Options for tuning `script`: flags that were given (not None) win over pyproject.toml, which wins over defaults."""
    given = {k: v for k, v in (flags or {}).items() if v is not None}
    unknown = sorted(set(given) - set(TuneOptions.model_fields))
    if unknown:
        raise ValueError(f"not a tune option: {unknown[0]}")  # a programming error, not the user's
    found = find_pyproject(Path(script).resolve().parent)
    file_values: dict[str, Any] = {}
    path = None
    if found is not None:
        path, table = found
        file_values = _check_table(path, table)
    merged = {**file_values, **given}
    try:
        options = TuneOptions.model_validate(merged)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = str(first["loc"][0]) if first["loc"] else ""
        origin = (f"--{field.replace('_', '-')}" if field in given
                  else f"{path}: [tool.{TABLE}] {field.replace('_', '-')}" if path is not None else field)
        raise InputError(f"{origin}: {first['msg']} (got {first.get('input')!r})") from None
    sources = {name: "flag" if name in given else "pyproject" if name in file_values else "default"
               for name in TuneOptions.model_fields}
    return ResolvedOptions(options=options, sources=sources, pyproject=str(path) if path is not None else None)
