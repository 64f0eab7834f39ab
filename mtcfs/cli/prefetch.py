"""`mtcfs prefetch`: pull files (a step) into this node's RAM tier, with a progress bar."""

from __future__ import annotations

import json
import os

import click

from mtcfs.cli.common import daemon_request, fail, plural
from mtcfs.cli.persist import mount_relative
from mtcfs.cli.progress import poll_with_progress
from mtcfs.sizes import format_size


@click.command("prefetch")
@click.argument("mountpoint", type=click.Path())
@click.argument("paths", nargs=-1)
@click.option("--restore", is_flag=True,
              help="instead of PATHS: wait for this host's background restore (a "
                   "replacement host pulling the copies it held), e.g. in an init container")
@click.option("--parallel", type=click.IntRange(1, 64), default=4, show_default=True,
              help="files fetched at the same time")
@click.option("--json", "as_json", is_flag=True,
              help="print the outcome as JSON on stdout (the progress bar stays on stderr)")
def prefetch(mountpoint: str, paths: tuple[str, ...], restore: bool, parallel: int,
             as_json: bool) -> None:
    """Fetch the files under PATHS into local RAM, from peers (or the durable tier).

    Useful on a replacement host before the trainer restarts: reads then run at
    RAM speed. Returns once every file is here or failed. With --restore, follows
    the restore a replacement host starts by itself instead."""
    if bool(paths) == restore:
        raise click.UsageError("give PATHS or --restore (not both)")
    mp = os.path.abspath(mountpoint)
    if restore:
        r = daemon_request(mp, "prefetch", restore=True)
    else:
        rels = [mount_relative(mp, p) for p in paths]
        r = daemon_request(mp, "prefetch", paths=rels, parallel=parallel)
    if not as_json:
        click.echo(f"{plural(r['files'], 'file')}, {format_size(r['bytes'])}; fetching "
                   f"{r['to_fetch']} ({format_size(r['bytes_to_fetch'])})", err=True)
    inos = r["inos"]
    st = poll_with_progress("prefetching", lambda: daemon_request(mp, "prefetch_progress",
                                                                   inos=inos))
    if as_json:
        click.echo(json.dumps({"files": st["files_done"], "bytes": st["bytes_total"],
                               "fetched_files": r["to_fetch"],
                               "fetched_bytes": r["bytes_to_fetch"], "failed": st["failed"],
                               "mount_bytes_by_source": st["sources"]}, indent=2))
    else:
        for path, why in st["failed"].items():
            click.echo(f"mtcfs: {path}: {why}", err=True)
    if st["failed"]:
        fail(f"{plural(len(st['failed']), 'file')} could not be fetched")
    if not as_json:
        sources = ", ".join(f"{format_size(n)} from {src}" for src, n in st["sources"].items())
        click.echo(f"{plural(st['files_done'], 'file')} in RAM, {format_size(st['bytes_total'])}"
                   + (f" (this mount so far: {sources})" if sources else ""), err=True)
