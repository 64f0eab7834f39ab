"""`mtcfs steps`: checkpoint steps, whether complete, and where their copies are."""

from __future__ import annotations

import json
import os

import click

from mtcfs.cli.common import daemon_request, plural, print_table
from mtcfs.sizes import format_size


@click.command("steps")
@click.argument("mountpoint", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def steps(mountpoint: str, as_json: bool) -> None:
    """List the checkpoint steps in the mount at MOUNTPOINT."""
    r = daemon_request(os.path.abspath(mountpoint), "steps")
    if as_json:
        click.echo(json.dumps({k: r[k] for k in ("steps", "newest_complete_safe", "replicas",
                                                 "keep_steps", "durable")}, indent=2))
        return
    rows = []
    for s in r["steps"]:
        if s.get("withdrawn"):
            complete = f"WITHDRAWN ({len(s['lost_files'])} lost)"
        elif s["temporary"]:
            complete = "no (temporary name)"
        elif s["complete"]:
            complete = "yes"
        else:
            complete = f"no ({s['open_files']} open)" if s["open_files"] else "no (no marker)"
        lo, hi = s["replicas_min"], s["replicas_max"]
        if s["in_ram"]:
            ram = "all" + (" (kept)" if s["kept"] else "")
        elif s["files_in_ram"] == 0:
            ram = "evicted"
        else:
            ram = f"{s['files_in_ram']}/{s['files']}"
        rows.append([
            "-" if s["step"] is None else str(s["step"]), s["path"], complete, str(s["files"]),
            format_size(s["bytes"]),
            (str(lo) if lo == hi else f"{lo}-{hi}") + f"/{r['replicas']}" if r["replicas"]
            else "-",
            ram,
            "n/a" if r["durable"] is None else
            "yes" if s["persisted"] else f"{s['files_persisted']}/{s['files']}",
            "yes" if s["safe"] else "no",
        ])
    print_table(f"steps in {mountpoint}", ["step", "path", "complete", "files", "size",
                                           "replicas", "in RAM", "persisted", "safe"],
                rows, right=("files", "size"))
    newest = r["newest_complete_safe"]
    k = r["replicas"]
    where = " or ".join(w for w, on in ((f"{plural(k, 'peer copy', 'peer copies')}", k),
                                       ("the durable tier", r["durable"])) if on)
    click.echo(f"newest complete step safe (in {where}): {newest or 'none'}" if where else
               "newest complete step safe: none (no peer copies and no durable tier here)")
    n = r["keep_steps"]
    if n:
        click.echo("retention: the newest complete step stays in RAM" if n == 1 else
                   f"retention: the newest {n} complete steps stay in RAM")
