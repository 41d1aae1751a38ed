"""The `tpu-agent` command line: the app, its commands, and the one place failures become `error:` lines.

Every command is a module of this package with a `register(app)` (each
imports its heavy parts inside the command, so `--help` stays fast). A command
line that names its command (`tpu-agent run ...`) builds the app with that
command alone: the other commands' modules (pydantic schemas, rich tables) are
not imported by a process that does not run them. `app`, with every command, is
built on first use.
Commands raise `TpuAgentError`/`InputError` or return an exit code; `main()`
alone turns failures into one `error: ...` line on stderr, so every command,
present and future, fails the same way (exit 1 job failed, 2 bad usage/input).
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import os
import sys
from typing import Annotated, NoReturn

import typer

try:  # typer >= 0.2x vendors click
    from typer._click import exceptions as click_exceptions
except ImportError:  # pragma: no cover - older typer on real click
    from click import exceptions as click_exceptions

from tpu_agent import __version__
from tpu_agent.errors import TpuAgentError

from tpu_agent.cli.options import PROG

# The commands' modules, in the order `--help` lists them.
COMMANDS = ("doctor", "run", "profile", "knobs", "diff", "tune", "playbooks", "project")


def build_app(commands: tuple[str, ...] = COMMANDS) -> typer.Typer:
    """The app with these commands registered (their modules imported now)."""
    built = typer.Typer(
        name=PROG,
        help="Run, profile and tune PyTorch training scripts on a `tpu` device.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
        rich_markup_mode="rich",
        context_settings={"help_option_names": ["-h", "--help"]},
    )
    built.callback()(_root)
    for name in commands:
        importlib.import_module(f"tpu_agent.cli.{name}").register(built)
    return built


_BUILT: dict[tuple[str, ...], typer.Typer] = {}


def _app_for(commands: tuple[str, ...]) -> typer.Typer:
    if commands not in _BUILT:
        _BUILT[commands] = build_app(commands)
    return _BUILT[commands]


def __getattr__(name: str):
    if name == "app":  # every command: `--help`, typer's testing, the shared-option checks
        return _app_for(COMMANDS)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _version_callback(value: bool) -> None:
    if value:
        print(f"{PROG} {__version__}")
        raise typer.Exit(0)


def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version_callback, is_eager=True, help="Print the version and exit."),
    ] = False,
) -> None:
    """Run, profile and tune PyTorch training scripts on a `tpu` device."""


# ---------------------------------------------------------------- entry


def _usage_line(exc: click_exceptions.UsageError) -> str:
    ctx = exc.ctx
    where = ctx.command_path if ctx is not None else PROG
    if isinstance(exc, click_exceptions.NoSuchOption):
        message = f"no such option: {exc.option_name}"
        takes_script_args = ctx is not None and any(p.name == "script_args" for p in ctx.command.params)
        if takes_script_args:
            return f"{message} (arguments for the script go after '--': {where} SCRIPT -- {exc.option_name} ...)"
        if exc.possibilities:
            message += f"; did you mean {' or '.join(sorted(exc.possibilities))}?"
        return f"{message} (see '{where} --help')"
    message = " ".join(exc.format_message().split()).rstrip(".")
    if message[:2].istitle():  # "Missing argument" -> "missing argument", leave "SCRIPT" alone
        message = message[0].lower() + message[1:]
    return f"{message} (see '{where} --help')"


def _error(message: str) -> None:
    sys.stdout.flush()
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()


def run_cli(argv: list[str] | None = None) -> int:
    """Run the app and return the exit code instead of exiting."""
    args = sys.argv[1:] if argv is None else argv
    named = args[0] if args and args[0] in COMMANDS else None  # `tpu-agent run ...`: that command alone
    command = typer.main.get_command(_app_for((named,) if named is not None else COMMANDS))
    try:
        rv = command.main(args=args, prog_name=PROG, standalone_mode=False)
    except click_exceptions.NoArgsIsHelpError as exc:
        # Bare `tpu-agent` asks for help. With rich the help is already printed
        # while the exception is built; without it, it is the message.
        if exc.format_message().strip():
            print(exc.format_message())
        return 0
    except click_exceptions.UsageError as exc:
        _error(_usage_line(exc))
        return 2
    except click_exceptions.ClickException as exc:
        _error(" ".join(exc.format_message().split()))
        return exc.exit_code
    except typer.Abort:
        _error("aborted")
        return 1
    except TpuAgentError as exc:
        _error(str(exc))
        return exc.exit_code
    except OSError as exc:
        if exc.errno not in REFUSALS:
            raise
        _stdout_refused(exc)  # a command's output to a full disk, a read-only file: the same one line
        return 1
    return rv if isinstance(rv, int) else 0


# What the environment refuses (tpu_agent.paths' policy): full disk, read-only, permissions, quota, I/O.
REFUSALS = {errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT, errno.EIO}


def _stdout_refused(exc: OSError) -> None:
    """One line for output that could not be written, and stdout pointed at the null device so that Python's
    own flush at exit does not print a second complaint."""
    with contextlib.suppress(OSError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    from tpu_agent.paths import cause, shown_path

    where = shown_path(exc.filename) if exc.filename else "the output (standard output)"  # any file of ours
    sys.stderr.write(f"error: cannot write {where}: {cause(exc)}\n")  # the disk is full, not only refused
    sys.stderr.flush()


def main() -> NoReturn:
    from tpu_agent.interrupts import keep_swallowed_interrupts

    keep_swallowed_interrupts()
    code = run_cli()
    try:
        sys.stdout.flush()
    except BrokenPipeError:  # `tpu-agent doctor | head -1`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = code or 1
    except OSError as exc:  # the last of the output to a full disk
        if exc.errno not in REFUSALS:
            raise
        _stdout_refused(exc)
        code = code or 1
    sys.exit(code)
