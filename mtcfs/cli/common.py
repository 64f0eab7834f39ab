"""Shared by the commands: errors that exit 1 with one line naming the cause."""

from __future__ import annotations

import sys
from typing import Any, NoReturn

import click
from rich.console import Console

from mtcfs import control


def fail(msg: str) -> NoReturn:
    click.echo(f"mtcfs: error: {msg}", err=True)
    sys.exit(1)


def usage_error(msg: str) -> NoReturn:
    click.echo(f"mtcfs: error: {msg}", err=True)
    sys.exit(2)


def daemon_request(mountpoint: str, op: str, **args: Any) -> dict[str, Any]:
    try:
        return control.request(mountpoint, op, **args)
    except control.ControlError as e:
        fail(str(e))


def table_console() -> Console:
    """Where tables are printed: the terminal's width on a terminal; piped into a
    file or another program, as wide as the table needs (no column cut to `compl…`)."""
    if sys.stdout.isatty():
        return Console()
    return Console(width=1000, no_color=True)
