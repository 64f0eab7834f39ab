"""Shared by the commands: errors that exit 1 with one line naming the cause."""

from __future__ import annotations

import sys
from typing import Any, NoReturn

import click

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
