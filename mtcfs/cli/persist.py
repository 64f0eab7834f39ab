"""`mtcfs persist`: upload files to the durable tier now, optionally waiting."""

from __future__ import annotations

import os

import click

from mtcfs.cli.common import daemon_request, fail
from mtcfs.cli.progress import poll_with_progress
from mtcfs.sizes import format_size


def mount_relative(mountpoint: str, path: str) -> str:
    """A path given on the command line, relative to the mount root."""
    full = os.path.abspath(path) if os.path.isabs(path) or os.path.exists(path) else None
    if full is None:
        return path.strip("/")
    rel = os.path.relpath(full, mountpoint)
    if rel == ".":
        return ""
    if rel.startswith(".."):
        fail(f"{path} is not inside the mount {mountpoint}")
    return rel


@click.command("persist")
@click.argument("mountpoint", type=click.Path())
@click.argument("paths", nargs=-1)
@click.option("--wait", is_flag=True, help="wait until everything is persisted (progress bar)")
def persist(mountpoint: str, paths: tuple[str, ...], wait: bool) -> None:
    """Upload closed files under PATHS (default: everything) to the durable tier.

    Commit markers still go last. Without --wait, returns once queued."""
    mp = os.path.abspath(mountpoint)
    rels = [mount_relative(mp, p) for p in paths]
    r = daemon_request(mp, "persist", paths=rels)
    note = f" ({r['skipped_open']} open files skipped)" if r["skipped_open"] else ""
    click.echo(f"queued {r['files']} files, {format_size(r['bytes'])}{note}", err=True)
    if not wait:
        return
    inos = r["inos"]

    def poll() -> dict:
        st = daemon_request(mp, "persist_progress", inos=inos)
        if st["retrying_in"] and st["last_error"]:
            st["note"] = f"retrying: {st['last_error'][:60]}"
        st["finished"] = st["finished"]
        return st

    st = poll_with_progress("persisting", poll)
    if st["failed"]:
        for path, why in st["failed"].items():
            click.echo(f"mtcfs: {path}: {why}", err=True)
        fail(f"{len(st['failed'])} files could not be persisted")
    click.echo(f"persisted {st['files_done']} files, {format_size(st['bytes_total'])}", err=True)
