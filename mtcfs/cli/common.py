"""Shared by the commands: errors that exit 1 with one line naming the cause."""

from __future__ import annotations

import sys
import textwrap
from typing import Any, NoReturn

import click
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

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


def plural(n: int, word: str, words: str | None = None) -> str:
    """`1 step`, `2 steps` (`words`: the plural where it is not word + "s")."""
    return f"{n} {word if n == 1 else words or word + 's'}"


def print_table(title: str, headers: list[str], rows: list[list[str]],
                right: tuple[str, ...] = (), show_header: bool = True) -> None:
    """A table on stdout, every cell whole. On a terminal as rich draws it, or, where it
    is too wide for the terminal, one line per row (`header value; ...`). Piped into a
    file or another program: plain text, no box characters, no trailing spaces.
    Without show_header: rows of a key (bold on a terminal) and its value."""
    tty = sys.stdout.isatty()
    table = Table(show_header=show_header, box=box.HEAVY_HEAD if tty and show_header else None,
                  pad_edge=tty and show_header, title=title if tty else None)
    for h in headers:
        table.add_column(h, justify="right" if h in right else "left",
                         style="bold" if not show_header and h == headers[0] else None)
    for row in rows:
        table.add_row(*(Text(cell) for cell in row))  # Text: no markup in paths
    if tty:
        console = Console()
        # (A key/value table wraps its values at spaces: nothing is cut.)
        wide = console.options.update_width(1 << 16)  # the table's natural width
        if not show_header or console.measure(table, options=wide).maximum <= console.width:
            console.print(table)
            return
        click.echo(title)
        for row in rows:
            line = "; ".join(f"{h} {c}" for h, c in zip(headers, row, strict=True))
            click.echo(textwrap.fill(line, console.width, subsequent_indent="    ",
                                     break_long_words=False, break_on_hyphens=False))
        return
    console = Console(width=1 << 16, no_color=True, highlight=False)
    with console.capture() as out:
        console.print(table)
    click.echo(title)
    for line in out.get().splitlines():
        click.echo(line.rstrip())
