"""Every option of `tpu-agent tune`, once: its default, its flag, its `[tool.tpu-agent]` key; the one pyproject reader.

The table is looked for from the script's directory upward: the nearest
pyproject.toml that has a `[tool.tpu-agent]` table is used (a monorepo's
package may have a pyproject.toml without one). Keys are the flags' long
names (`min-gain = 0.05`; `min_gain` is read the same). An unknown key, a
wrong type or a bad TOML file is an InputError (exit 2) naming the file and key,
so a typo is never silently ignored. Paths in the table (`playbooks`,
`output-dir`) are relative to the pyproject.toml's folder.

    [tool.tpu-agent]
    trials = 40
    target = "v5e"
    objective = "both"
    min-gain = 0.05
    playbooks = "tuning/playbooks"      # or a list of folders
    storage = "postgresql://optuna@db/studies"
"""

from __future__ import annotations

import difflib
import hashlib
import json
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from tpu_agent.errors import InputError

TABLE = "tpu-agent"

Target = Literal["cpu", "v4", "v5e", "v5p", "v6e", "v7x"]
Objective = Literal["time", "memory", "both"]
ProposerName = Literal["auto", "offline", "claude"]
PATH_KEYS = ("playbooks", "output_dir")  # resolved against the folder of the file that names them


class TuneOptions(BaseModel):
    """Every `tune` option, with its default. A field here is a key in [tool.tpu-agent] and a flag."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)  # trials = "20" is a typo to report

    trials: int = Field(20, ge=1, description="trials to run (measured configurations)")
    timeout: float | None = Field(None, gt=0, description="stop starting trials after this many seconds")
    trial_timeout: float = Field(600.0, gt=0, description="a trial step running longer is stopped and recorded as failed")
    steps: int = Field(20, ge=5, description=(
        "interleaved baseline/candidate pairs per trial, after warm-up; every measured process runs this length"))
    warmup: int = Field(2, ge=1, description="steps each process runs before it is timed (compilation)")
    pairs: int = Field(20, ge=5, description=(
        "pairs a verification or an ablation measures, in rounds of --steps pairs, each in fresh processes"))
    verify: int = Field(3, ge=0, description=(
        "how many of the search's best plans are verified in fresh processes (0: search only, nothing verified)"))
    target: Target = Field("cpu", description="what to tune for: this machine, or a TPU generation (cost model)")
    objective: Objective = Field("time", description="step time, peak memory, or both")
    devices: int = Field(1, ge=1, description="simulated devices on a CPU (for sharding)")
    seed: int = Field(0, description="seed of the sampler and of the bootstrap")
    study: str | None = Field(None, description="Optuna study name (default: from the script)")
    storage: str | None = Field(None, description="Optuna storage URL (default: SQLite under .tpu-agent/)")
    resume: bool = Field(False, description="continue the study instead of starting a new one")
    min_gain: float = Field(0.03, ge=0, lt=1, description="a speedup is kept when its CI's lower end exceeds 1 + this")
    loss_tol: float = Field(0.02, ge=0, lt=1, description="a shape-changing plan may end with a loss this much worse")
    apply: bool = Field(False, description="write the verified changes into the user's files (with a backup)")
    force: bool = Field(False, description="with apply: overwrite files that have uncommitted changes")
    output_dir: str | None = Field(None, description="where run directories go (default ./.tpu-agent/runs)")
    playbooks: list[str] = Field(default_factory=list, description="extra playbook directories (a folder or a list)")
    proposer: ProposerName = Field("auto", description="auto: claude when ANTHROPIC_API_KEY is set")
    model: str | None = Field(None, description="Claude model for the claude proposer")
    rounds: int = Field(1, ge=1, description="propose-search rounds (the claude proposer sees earlier results)")
    token_budget: int = Field(200_000, ge=1000, description="Claude tokens for the whole tune")
    candidates: int = Field(6, ge=1, description="how many top candidates span the search space")
    allow: list[Literal["model", "training"]] = Field(default_factory=list, description=(
        "classes of change searched beyond exact and numerics: model (architecture: widths, vocabulary rows), "
        "training (batch size, sequence length); the data is never changed"))

    @field_validator("allow", mode="before")
    @classmethod
    def _comma_separated(cls, value):
        items = [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else value
        if isinstance(items, list) and "data" in items:
            raise ValueError("data is never changed by the tuner (allow takes model, training)")
        return sorted(set(items)) if isinstance(items, list) else items

    @field_validator("playbooks", mode="before")
    @classmethod
    def _one_folder_or_a_list(cls, value):
        return [value] if isinstance(value, str) else value

    @property
    def verify_pairs(self) -> int:
        """Pairs for a verification or an ablation: noise on a shared host wants an ample sample (20 pairs
        pass a real 15 % gain every time; 10, about 92 % of the time)."""
        return max(self.pairs, self.steps)

    @property
    def verify_rounds(self) -> int:
        """Fresh process pairs a verification or an ablation runs, each the trials' length (--steps): a script
        is measured over the same steps whether a trial or a verification runs it."""
        return -(-self.verify_pairs // self.steps)

    def runs_root(self) -> Path:
        return Path(self.output_dir) if self.output_dir else Path.cwd() / ".tpu-agent" / "runs"

    def fingerprint(self, script: Path, args: list[str]) -> str:
        """What makes two runs the same study: the script, its args and the measuring settings."""
        keep = self.model_dump(include={"steps", "warmup", "target", "objective", "min_gain", "loss_tol"})
        keep["devices"] = self.devices if self.devices > 1 else None  # as studies made before recorded it
        if self.allow:  # another search space; absent when empty, as studies made before recorded it
            keep["allow"] = self.allow
        text = json.dumps({"script": str(script), "args": args, **keep}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


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


def folders(value: Any, base: Path) -> list[str]:
    """A folder or a list of folders, each resolved against `base`; ValueError when it is neither."""
    entries = [value] if isinstance(value, str) else value
    if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
        raise ValueError("must be a directory or a list of directories")
    return [str((base / e).resolve()) for e in entries]


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


def _paths(values: dict[str, Any], base: Path, origin: str) -> dict[str, Any]:
    out = dict(values)
    try:
        if out.get("playbooks") is not None:
            out["playbooks"] = folders(out["playbooks"], base)
        if isinstance(out.get("output_dir"), str):
            out["output_dir"] = str((base / out["output_dir"]).resolve())
    except ValueError as exc:
        raise InputError(f"{origin} playbooks: {exc}") from None
    return out


def resolve(script: Path | str, flags: dict[str, Any] | None = None) -> ResolvedOptions:
    """Options for tuning `script`: flags that were given (not None) win over pyproject.toml, which wins over
    defaults; `playbooks` adds up (the project's, then the flags')."""
    given = {k: v for k, v in (flags or {}).items() if v is not None}
    unknown = sorted(set(given) - set(TuneOptions.model_fields))
    if unknown:
        raise ValueError(f"not a tune option: {unknown[0]}")  # a programming error, not the user's
    found = find_pyproject(Path(script).resolve().parent)
    file_values: dict[str, Any] = {}
    path = None
    if found is not None:
        path, table = found
        file_values = _paths(_check_table(path, table), path.parent, f"{path}: [tool.{TABLE}]")
    flag_values = _paths(given, Path.cwd(), "--playbooks:")
    merged = {**file_values, **flag_values}
    if "playbooks" in file_values and "playbooks" in flag_values:
        merged["playbooks"] = list(dict.fromkeys([*file_values["playbooks"], *flag_values["playbooks"]]))
    try:
        options = TuneOptions.model_validate(merged)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = str(first["loc"][0]) if first["loc"] else ""
        origin = (f"--{field.replace('_', '-')}" if field in given
                  else f"{path}: [tool.{TABLE}] {field.replace('_', '-')}" if path is not None else field)
        message = first["msg"].removeprefix("Value error, ")
        raise InputError(f"{origin}: {message} (got {first.get('input')!r})") from None
    sources = {name: "flag" if name in given else "pyproject" if name in file_values else "default"
               for name in TuneOptions.model_fields}
    return ResolvedOptions(options=options, sources=sources, pyproject=str(path) if path is not None else None)
