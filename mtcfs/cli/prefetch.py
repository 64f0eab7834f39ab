"""`mtcfs prefetch`: pull files (a step) into this node's RAM tier, with a progress bar."""

from __future__ import annotations

import os

import click

from mtcfs.cli.common import daemon_request, fail
from mtcfs.cli.persist import mount_relative
from mtcfs.cli.progress import poll_with_progress
from mtcfs.sizes import format_size


@click.command("prefetch")
@click.argument("mountpoint", type=click.Path())
@click.argument("paths", nargs=-1, required=True)
@click.option("--parallel", type=click.IntRange(1, 64), default=4, show_default=True,
              help="files fetched at the same time")
def prefetch(mountpoint: str, paths: tuple[str, ...], parallel: int) -> None:
    """Fetch the files under PATHS into local RAM, from peers (or the durable tier).

    Useful on a replacement host before the trainer restarts: reads then run at
    RAM speed. Returns once every file is here or failed."""
    mp = os.path.abspath(mountpoint)
    rels = [mount_relative(mp, p) for p in paths]
    r = daemon_request(mp, "prefetch", paths=rels, parallel=parallel)
    click.echo(f"{r['files']} files, {format_size(r['bytes'])}; fetching {r['to_fetch']} "
               f"({format_size(r['bytes_to_fetch'])})", err=True)
    inos = r["inos"]
    st = poll_with_progress("prefetching", lambda: daemon_request(mp, "prefetch_progress",
                                                                   inos=inos))
    if st["failed"]:
        for path, why in st["failed"].items():
            click.echo(f"mtcfs: {path}: {why}", err=True)
        fail(f"{len(st['failed'])} files could not be fetched")
    sources = ", ".join(f"{format_size(n)} from {src}" for src, n in st["sources"].items())
    click.echo(f"{st['files_done']} files in RAM, {format_size(st['bytes_total'])}"
               + (f" (this mount so far: {sources})" if sources else ""), err=True)
