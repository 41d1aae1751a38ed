"""Every option of `tpu-agent tune`, declared once; the one pyproject reader.

Each option is one field of TuneOptions, declared with `option(...)`: its name and type (the field's), its
default, its help, how the command line spells it, and its checks. From that declaration come the
option's default here, `tune --help` (its text and `[default: ...]`, cli/tune.py) and the validation of
its `[tool.tpu-agent]` key (the name with dashes); no other copy of a default or a help text exists.

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
import re
import tomllib
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_serializer, field_validator

from tpu_agent.errors import InputError

TABLE = "tpu-agent"

Target = Literal["cpu", "v4", "v5e", "v5p", "v6e", "v7x"]  # or a slice of one, e.g. v6e-256 (TuneOptions.slice)
Objective = Literal["time", "memory", "both"]
ChosenProposer = Literal["offline", "claude"]  # who proposes, once propose.choose_proposer has decided
ProposerName = Literal["auto", ChosenProposer]  # what --proposer asks for
PATH_KEYS = ("playbooks", "output_dir")  # resolved against the folder of the file that names them
MIN_PAIRS = 5  # the fewest pairs a comparison is judged on: --steps' and --pairs' lower limit, the statistics' floor


def redact_url(url: str) -> str:
    """A database URL with its password as ***: what the tool prints or writes of a --storage URL."""
    return re.sub(r"//([^:/@]+):([^@]+)@", r"//\1:***@", url)


def option(default: Any, help: str, *, shown: str | None = None, metavar: str | None = None,
           short: str | None = None, **checks: Any) -> Any:
    """One tune option: its default, its help (`tune --help` adds `[default: ...]`), `shown` for a default
    better said in words, the command line's `metavar` and `short` name, and pydantic's `checks` (ge=1...)."""
    cli = {key: value for key, value in (("shown", shown), ("metavar", metavar), ("short", short)) if value}
    default_kw = {"default_factory": list} if default == [] else {"default": default}
    return Field(**default_kw, description=help, json_schema_extra=cli or None, **checks)


def _either(choices) -> str:
    return " | ".join(get_args(choices))


class Declared(BaseModel):
    """An option more than one command takes (tune, profile, run), declared once: every command builds its flag
    from this (cli/options.py), and TuneOptions its field (`declared`). No command has its own help or bounds."""

    model_config = ConfigDict(frozen=True)

    default: Any
    help: str
    metavar: str | None = None
    short: str | None = None
    ge: int | None = None  # the lower bound: pydantic's for tune and [tool.tpu-agent], click's for profile and run


SHARED: dict[str, Declared] = {
    # None: the script as python runs it. 1: one rank with torchrun's variables set, so that a torchrun script's
    # init_process_group() finds a group of one; in a tune every process gets its own MASTER_PORT (run.launch, as
    # the tune's warm processes run side by side). TuneOptions holds 1 for both (one process to measure); the tune
    # tells them apart by where the value came from (ResolvedOptions.sources).
    "nproc": Declared(
        default=None, metavar="N", ge=1,
        help="Ranks on this host, each a process started by PyTorch's launcher (as torchrun --nproc-per-node N); "
             "profile gathers every rank's profile, tune times a step by its slowest rank. Default: one process, as "
             "python runs it; 1: one rank with torchrun's variables set."),
    # At least 1 in every command: a tune times its pairs after the warm-up, so 0 would time compilation; a profile
    # with 0 counted the first step's compilation in its step statistics, FLOPs and MFU. The compile cost has its own
    # line in both (the warm-up summary), and a script that ends inside the warm-up is still measured whole.
    "warmup": Declared(default=2, ge=1,
                       help="Steps each process runs before timing, left out of the statistics (compilation, >= 1)."),
    "target": Declared(
        default="cpu", metavar="TARGET",
        help=f"What to measure for: {_either(Target)} (this machine, or a TPU generation's cost model: roofline "
             "estimates and the padding report), or a TPU slice such as v6e-256, tpu7x-4x4x4 or 2xv5e-4 (its "
             "generation's estimates; tune also ranks plans by projection onto the slice, an estimate)."),
    "output_dir": Declared(default=None, metavar="DIR", short="-o",
                           help="Where run directories go (default ./.tpu-agent/runs)."),
}


def one_rank() -> bool:
    """Whether this tune runs the script as one rank of a torchrun job (`--nproc 1` given: cli/tune.py sets
    TPU_AGENT_ONE_RANK for every child it launches), which makes another study than one process as python runs it."""
    from tpu_agent import envvars

    return envvars.ONE_RANK.value


def declared(name: str, **checks: Any) -> Any:
    """TuneOptions' field for a shared option, from its declaration (`checks`: pydantic's, for the field only)."""
    d = SHARED[name]
    bounds = {"ge": d.ge} if d.ge is not None else {}
    return option(d.default, d.help, metavar=d.metavar, short=d.short, **bounds, **checks)


def check_target(value: str) -> str:
    """A generation, or a slice as `tpu-agent project` parses it (one the generation offers); ValueError else."""
    if value in get_args(Target):
        return value
    from tpu_agent.slices import read

    try:
        read(value)
    except InputError as exc:  # its message starts `--target 'v6e-7': `; the caller names where it came from
        reason = str(exc).split(": ", 1)[-1]
        if reason.startswith("expected a slice"):
            reason = f"expected {_either(Target)}, or a slice such as v6e-256 (a generation, a dash, its size)"
        raise ValueError(reason) from None
    return value


def target_generation(value: str) -> str:
    """The generation a checked --target models: itself, or a slice's (`v5e-8`: v5e); `cpu` is this machine."""
    if value in get_args(Target):
        return value
    from tpu_agent.slices import read

    return read(value).generation


class TuneOptions(BaseModel):
    """Every `tune` option, declared once. A field here is a key in [tool.tpu-agent] and a flag."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)  # trials = "20" is a typo to report

    trials: int = option(20, "Trials to run (measured configurations).", ge=1)
    timeout: float | None = option(None, "Stop starting trials after this many seconds.", gt=0)
    trial_timeout: float = option(600.0, "A trial step running longer is stopped and recorded as failed.", gt=0)
    steps: int = option(20, f"Interleaved baseline/candidate pairs per trial (>= {MIN_PAIRS}); every measured process "
                        "runs this length.", ge=MIN_PAIRS)
    warmup: int = declared("warmup")
    pairs: int = option(20, f"Pairs a verification or an ablation measures (>= {MIN_PAIRS}), shared out over "
                        "--processes fresh process pairs.", ge=MIN_PAIRS)
    processes: int = option(3, "Fresh baseline/candidate process pairs a verification and each ablation unit "
                            "measure (at least; more when --pairs exceeds --steps per pair); the interval counts the "
                            "spread between them (a two-level bootstrap).", ge=1)
    verify: int = option(3, "How many of the best plans to verify in fresh processes (0: search only, nothing "
                         "verified).", ge=0)
    target: str = declared("target")
    slices: int = option(1, "With a slice --target: N such slices joined by the data-center network (multislice, the "
                         "data axis spanning them), for the projected ranking.", metavar="N", ge=1)
    objective: Objective = option("time", f"{_either(Objective)}: step time, peak memory, or both.")
    devices: int = option(1, "Simulated devices on a CPU host (for sharding).", ge=1)
    nproc: int | None = declared("nproc", validate_default=True)  # None (not given) and 1: one process, as python
    seed: int = option(0, "Seed of the sampler and the bootstrap.")
    study: str | None = option(None, "Optuna study name (default: from the script and settings).")
    storage: str | None = option(None, "Optuna storage URL (default: SQLite under .tpu-agent/).")
    resume: bool = option(False, "Continue the study; finished trials are not repeated.")
    workers: int = option(1, "Workers on this host filling the study together, each measuring against its own "
                          "warm baseline (a shared --storage lets other hosts --join).", ge=1)
    join: str | None = option(None, "Be one more worker of the study STUDY in --storage: measure its plans on this "
                              "host until it has its trials; the tune that started it verifies.", metavar="STUDY")
    verify_on: str | None = option(None, "The host that verifies and ablates the study's best plans (default: the "
                                   "one that started it).", metavar="HOST")
    min_gain: float = option(0.03, "Keep a speedup only if its CI's lower end exceeds 1 + this.", ge=0, lt=1)
    loss_tol: float = option(0.02, "A shape-changing plan may end with a loss this much worse.", ge=0, lt=1)
    apply: bool = option(False, "Write the verified source change into your files (backup kept).")
    force: bool = option(False, "With --apply: overwrite files with uncommitted changes.")
    output_dir: str | None = declared("output_dir")
    playbooks: list[str] = option([], "Extra playbook directories (in [tool.tpu-agent]: a folder or a list).",
                                  metavar="DIR")
    proposer: ProposerName = option("auto", f"{_either(ProposerName)} (auto: claude when ANTHROPIC_API_KEY is set).")
    model: str | None = option(None, "Claude model for --proposer claude.")
    rounds: int = option(1, "Propose-search rounds; Claude sees the results of earlier rounds.", ge=1)
    token_budget: int = option(200_000, "Claude tokens for the whole tune.", ge=1000)
    candidates: int = option(6, "Top candidates that span the search space.", ge=1)
    allow: list[Literal["model", "training"]] = option(
        [], "Also search these classes of change (comma-separated): model (architecture: widths, vocabulary rows), "
        "training (batch size, sequence length). The data is never changed.", shown="exact and numerics only",
        metavar="CLASSES")

    @field_validator("target")
    @classmethod
    def _generation_or_slice(cls, value: str) -> str:
        return check_target(value)

    @field_validator("nproc")
    @classmethod
    def _one_process(cls, value: int | None) -> int:
        """Not given: one process (given as 1, a rank of one: cli/tune.py reads that from the sources)."""
        return 1 if value is None else value

    @field_validator("slices")
    @classmethod
    def _slices_of_a_slice(cls, value: int, info) -> int:
        if value > 1 and info.data.get("target", "cpu") in get_args(Target):
            raise ValueError("several slices need a slice --target (e.g. --target tpu7x-4x8x8 --slices 32)")
        return value

    @property
    def slice(self) -> str | None:
        """The slice --target names (`v6e-256`; `32xtpu7x-4x8x8` with --slices 32), else None."""
        if self.target in get_args(Target):
            return None
        return self.target if self.slices == 1 else f"{self.slices}x{self.target}"

    @property
    def generation(self) -> str:
        """The TPU generation the estimates model (`cpu`: this machine); a slice's generation for a slice."""
        return target_generation(self.target)

    @field_validator("allow", mode="before")
    @classmethod
    def _comma_separated(cls, value):
        items = [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else value
        if isinstance(items, list) and "data" in items:
            raise ValueError("data is never changed by the tuner (allow takes model, training)")
        return sorted(set(items)) if isinstance(items, list) else items

    @field_serializer("storage")
    def _no_password(self, url: str | None) -> str | None:
        """Written out (tune.json, report.json), a storage URL's password is ***: only the live option holds it."""
        return redact_url(url) if url else url

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
        """Fresh process pairs a verification or an ablation runs: --processes, or more when the pairs would not
        fit in that many processes of a trial's length (--steps)."""
        return max(self.processes, -(-self.verify_pairs // self.steps))

    @property
    def round_pairs(self) -> int:
        """Interleaved pairs each of those process pairs measures: the verification's pairs shared out (at least
        MIN_STEADY = 3, at most a trial's --steps): fewer steps per process, more processes, about the same wall
        time."""
        return min(self.steps, max(3, -(-self.verify_pairs // self.verify_rounds)))

    def runs_root(self) -> Path:
        return Path(self.output_dir) if self.output_dir else Path.cwd() / ".tpu-agent" / "runs"

    def fingerprint(self, script: Path, args: list[str]) -> str:
        """What makes two runs the same study: the script, its args and the measuring settings."""
        keep = self.model_dump(include={"steps", "warmup", "target", "objective", "min_gain", "loss_tol"})
        keep["devices"] = self.devices if self.devices > 1 else None  # as studies made before recorded it
        if self.nproc > 1 or one_rank():  # another job: absent as python runs it, as studies made before recorded it
            keep["nproc"] = self.nproc
        if self.slices > 1:  # another target: absent at one slice, as studies made before recorded it
            keep["slices"] = self.slices
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
