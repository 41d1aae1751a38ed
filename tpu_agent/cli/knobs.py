"""`tpu-agent knobs SCRIPT [-- ARGS]`: the integer literals that become tensor dims, and what to pad them to.

Static: nothing of the script runs. Ranked by a baseline profile when there is
one: `--profile PATH`, else the newest profile of this script under
./.tpu-agent/runs (said in the output), else static only. Running the profiler
from here is left to `tpu-agent profile`: it runs the user's script, which
this command promises not to do.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tpu_agent.cli.format import percent
from tpu_agent.errors import InputError, validation_line
from tpu_agent.cli.inputs import check_script
from tpu_agent.paths import RUNS_SUBDIR, shown_path

from tpu_agent.profilers.session import PROFILE_FILE


def load_profile(path: Path):
    """A Profile from a profile.json or a run directory holding one; InputError (exit 2) if it is not one."""
    from tpu_agent.profilers.schema import Profile

    path = Path(path)
    if path.is_dir():
        path = path / PROFILE_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise InputError(f"profile not found: {path}") from None
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        return Profile.model_validate_json(text), path
    except ValidationError as exc:
        raise InputError(f"not a tpu-agent profile: {path}: {validation_line(exc, where_if_none='the file')}") from None


def latest_profile(script: Path, runs_root: Path) -> Path | None:
    """The newest profile.json under `runs_root` recorded for this script (a run that did not fail)."""
    import json

    target = script.resolve()
    best: tuple[str, Path] | None = None
    if not runs_root.is_dir():
        return None
    for candidate in runs_root.glob(f"*/{PROFILE_FILE}"):
        try:
            data = json.loads(candidate.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict) or data.get("status") == "failed" or not data.get("script"):
            continue
        recorded = Path(data["script"])
        if not recorded.is_absolute():
            recorded = Path(data.get("cwd") or ".") / recorded
        if recorded.resolve() != target:
            continue
        stamp = str(data.get("created_at") or "")
        if best is None or stamp > best[0]:
            best = (stamp, candidate)
    return best[1] if best else None


def _percent(value: float | None) -> str:
    return percent(value, fine_below=0.01)


def render(report, console: Console) -> None:
    console.print(f"[bold]knobs[/bold] in [bold cyan]{escape(Path(report.script).name)}[/bold cyan]: "
                  f"{len(report.knobs)} integer literal(s) that become tensor dims "
                  f"(scanned {', '.join(escape(f) for f in report.files)})")
    console.print(f"[dim]{escape(report.note)}[/dim]")
    if not report.knobs:
        console.print("no knobs found: no integer literal reaches a tensor size argument")
        return
    profiled = report.profile is not None
    table = Table(box=None, pad_edge=False, header_style="bold")
    table.add_column("where")
    table.add_column("name")
    table.add_column("value", justify="right")
    table.add_column("try")
    if profiled:
        table.add_column("FLOP share", justify="right")
        table.add_column("padding waste (estimate)", justify="right")
    table.add_column("class")
    table.add_column("used as")
    table.add_column("notes")
    for k in report.knobs:
        notes = []
        if k.batch:
            notes.append("batch size: compared per sample")
        elif k.effect == "data":
            notes.append("shapes the data: never proposed")
        if k.group is not None and k.group_members(report.knobs):
            notes.append("pad with its group")
        if k.overridden:
            notes.append(k.overridden)
        if k.unused:
            notes.append(f"not searched: {k.unused}")
        if k.modules:  # "Embedding(...) x1: transformer.wte" -> "Embedding transformer.wte"
            shown = [f"{m.split('(')[0]} {m.split(': ', 1)[-1].split(', ')[0]}" for m in k.modules[:2]]
            notes.append("sizes " + ", ".join(shown) + (f" (+{len(k.modules) - 2} more)" if len(k.modules) > 2 else ""))
        if k.derived:
            notes.append("also sets " + ", ".join(str(v) for v in k.derived))
        uses = k.uses[0] + (f" (+{len(k.uses) - 1} more)" if len(k.uses) > 1 else "")
        try_ = ", ".join(str(c) for c in k.candidates) or "aligned"
        row = [f"{k.file}:{k.line}", k.name or "(literal)", str(k.value), try_]
        if profiled:
            row += [_percent(k.flop_share) if k.matched_ops else "-", _percent(k.padding_waste)]
        row += [k.effect, uses, "; ".join(notes)]
        style = "dim" if (not k.candidates or k.overridden or k.unused or k.effect == "data") else None
        table.add_row(*(escape(c) for c in row), style=style)
    console.print(table)


def knobs(
    script: Annotated[str, typer.Argument(metavar="SCRIPT", help="The training script.", show_default=False)],
    script_args: Annotated[
        list[str] | None,
        typer.Argument(metavar="ARGS", help="The script's arguments, after `--` (an option given here overrides its default).",
                       show_default=False),
    ] = None,
    profile: Annotated[
        Path | None,
        typer.Option("--profile", metavar="PATH", help="A profile.json (or its run directory) to rank the knobs by. "
                     "Default: the newest profile of SCRIPT under ./.tpu-agent/runs.", show_default=False),
    ] = None,
    static: Annotated[bool, typer.Option("--static", help="Ignore profiles: static scan only.")] = False,
    json_output: Annotated[bool, typer.Option("--json", help="Print the knobs as JSON.")] = False,
) -> int:
    """List the integer literals of SCRIPT that become tensor dims, with the padded values worth trying.

    A static scan (nothing runs), ranked by the FLOP share of the hot ops each
    knob's value appears in when a baseline profile is available.
    Example: [bold]tpu-agent knobs train.py --profile .tpu-agent/runs/<run>/profile.json[/bold]
    """
    from tpu_agent.propose.knobs import discover

    path = check_script(script)
    if static and profile is not None:
        raise InputError("--static and --profile contradict each other: pass one")
    from tpu_agent.run.device_use import HINT, profile_touched, refusal

    prof, used, note = None, None, None
    if profile is not None:
        prof, used = load_profile(profile)
        if not profile_touched(prof):  # its FLOP shares are all zero: not a ranking
            raise InputError(f"--profile {profile}: {refusal(script, 'rank the knobs by')}")
    elif not static:
        found = latest_profile(path, Path.cwd() / RUNS_SUBDIR)
        if found is not None:
            try:
                prof, used = load_profile(found)
            except InputError:
                prof = None  # an old or foreign profile is not worth failing over: static it is
            if prof is not None and not profile_touched(prof):
                prof, used = None, None
                note = f"static only: the newest profile of this script ran no op on the tpu device; {HINT}"
    if prof is None and not static and profile is None and note is None:
        note = (f"static only: no profile of this script under {RUNS_SUBDIR} (run `tpu-agent profile {script} "
                "--steps 5` first, or pass --profile PATH); values already a multiple of 128 last")
    shown = shown_path(used) if used is not None else None
    report = discover(path, profile=prof, script_args=script_args or [], profile_path=shown, note=note)
    if json_output:
        sys.stdout.write(report.model_dump_json(indent=2) + "\n")
    else:
        render(report, Console(soft_wrap=True, highlight=False, width=None if sys.stdout.isatty() else 200))
    return 0


def register(app: typer.Typer) -> None:
    app.command("knobs")(knobs)
