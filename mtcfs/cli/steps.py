"""`mtcfs steps`: checkpoint steps, whether complete, and where their copies are."""

from __future__ import annotations

import json
import os

import click
from rich.console import Console
from rich.table import Table

from mtcfs.cli.common import daemon_request
from mtcfs.config import format_size


@click.command("steps")
@click.argument("mountpoint", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def steps(mountpoint: str, as_json: bool) -> None:
    """List the checkpoint steps in the mount at MOUNTPOINT."""
    r = daemon_request(os.path.abspath(mountpoint), "steps")
    if as_json:
        click.echo(json.dumps({k: r[k] for k in ("steps", "newest_complete_safe", "durable")},
                              indent=2))
        return
    t = Table(title=f"steps in {mountpoint}")
    for col in ("step", "path", "complete", "files", "size", "in RAM", "persisted"):
        t.add_column(col, justify="right" if col in ("files", "size") else "left")
    for s in r["steps"]:
        if s["temporary"]:
            complete = "no (temporary name)"
        elif s["complete"]:
            complete = "yes"
        else:
            complete = f"no ({s['open_files']} open)" if s["open_files"] else "no (no marker)"
        t.add_row(
            "-" if s["step"] is None else str(s["step"]), s["path"], complete, str(s["files"]),
            format_size(s["bytes"]),
            "all" if s["in_ram"] else f"{s['files_in_ram']}/{s['files']}",
            "n/a" if r["durable"] is None else
            "yes" if s["persisted"] else f"{s['files_persisted']}/{s['files']}",
        )
    Console().print(t)
    newest = r["newest_complete_safe"]
    click.echo(f"newest complete step safe in the durable tier: {newest or 'none'}")
