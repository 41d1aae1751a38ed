"""`tpu-agent playbooks list | show ID | validate PATH`: see, read and check tuning playbooks.

Loading is imported inside each command so `tpu-agent --help` stays fast.
Invalid input raises `PlaybookError` (an `InputError`): one `error: FILE: FIELD: PROBLEM` line, exit 2.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from tpu_agent.cli.options import stdout_console
from tpu_agent.errors import InputError
from tpu_agent.paths import shown_path

app = typer.Typer(  # a group of commands, registered as `tpu-agent playbooks`
    name="playbooks",
    help="List, show and validate tuning playbooks (built-in, the project's, and --playbooks DIR).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)

stdout = stdout_console()

PlaybooksOption = Annotated[
    list[Path] | None,
    typer.Option("--playbooks", metavar="DIR", help="Also load the playbooks in DIR (repeatable); "
                 "[tool.tpu-agent] playbooks in pyproject.toml is read too.", show_default=False),
]


def _load(dirs: list[Path] | None):
    from tpu_agent.propose.playbook import load_playbooks

    return load_playbooks(dirs or [], project_dir=Path.cwd())


def _where(pb) -> str:
    return "built-in" if pb.builtin else shown_path(pb.source)


def _summary(pb) -> dict:
    return {"id": pb.id, "title": pb.title, "tier": pb.rank.tier, "preserves_numerics": pb.preserves_numerics,
            "actions": [a.kind for a in pb.actions], "source": pb.source}


@app.command("list")
def list_(
    playbooks: PlaybooksOption = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print the list as JSON.")] = False,
) -> int:
    """List the playbooks the tuner would use, in ranking order (tier, then id)."""
    books = _load(playbooks)
    if json_output:
        sys.stdout.write(json.dumps([_summary(pb) for pb in books], indent=2) + "\n")
        return 0
    table = Table(box=None, pad_edge=False, header_style="bold")
    for col in ("id", "tier", "numerics", "actions", "title"):
        table.add_column(col, no_wrap=col != "title")
    for pb in books:
        title = pb.title if pb.builtin else f"{pb.title} (from {_where(pb)})"
        table.add_row(pb.id, str(pb.rank.tier), "exact" if pb.preserves_numerics else "may change",
                      ",".join(dict.fromkeys(a.kind for a in pb.actions)), escape(title))
    stdout.print(table)
    return 0


@app.command()
def show(
    playbook_id: Annotated[str, typer.Argument(metavar="ID", help="A playbook id from `playbooks list`.", show_default=False)],
    playbooks: PlaybooksOption = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print the parsed playbook as JSON.")] = False,
) -> int:
    """Print one playbook: its YAML as written, with where it comes from."""
    books = _load(playbooks)
    pb = next((p for p in books if p.id == playbook_id), None)
    if pb is None:
        raise InputError(f"no playbook {playbook_id!r} (known: {', '.join(p.id for p in books)})")
    if json_output:
        sys.stdout.write(json.dumps({**pb.model_dump(mode="json", by_alias=True, exclude_none=True),
                                     "source": pb.source}, indent=2) + "\n")
        return 0
    sys.stdout.write(f"# {pb.id} ({_where(pb)})\n{pb.text()}")
    return 0


@app.command()
def validate(
    path: Annotated[Path, typer.Argument(metavar="PATH", help="A playbook YAML file, or a directory of them.", show_default=False)],
) -> int:
    """Check a playbook file (or every *.yaml in a directory): exit 0 when valid, 2 with FILE: FIELD: PROBLEM."""
    from tpu_agent.propose.playbook import load_path

    books = load_path(path)
    if not books:
        raise InputError(f"{path}: no *.yaml playbooks found")
    stdout.print(f"ok: {escape(str(path))}: {len(books)} playbook(s): {escape(', '.join(pb.id for pb in books))}")
    return 0


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="playbooks")
