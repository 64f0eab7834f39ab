"""`mtcfs persist`: upload files to the durable tier now, optionally waiting."""

from __future__ import annotations

import json
import os

import click

from mtcfs.cli.common import daemon_request, fail, plural
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
@click.option("--json", "as_json", is_flag=True,
              help="print the outcome as JSON on stdout (the progress bar stays on stderr)")
def persist(mountpoint: str, paths: tuple[str, ...], wait: bool, as_json: bool) -> None:
    """Upload closed files under PATHS (default: everything) to the durable tier.

    Commit markers still go last. Without --wait, returns once queued."""
    mp = os.path.abspath(mountpoint)
    rels = [mount_relative(mp, p) for p in paths]
    r = daemon_request(mp, "persist", paths=rels)
    queued = {"queued_files": r["files"], "queued_bytes": r["bytes"],
              "skipped_open_files": r["skipped_open"]}
    if not as_json:
        note = (f" ({plural(r['skipped_open'], 'open file')} skipped)"
                if r["skipped_open"] else "")
        click.echo(f"queued {plural(r['files'], 'file')}, {format_size(r['bytes'])}{note}",
                   err=True)
    if not wait:
        if as_json:
            click.echo(json.dumps(queued, indent=2))
        return
    inos = r["inos"]

    def poll() -> dict:
        st = daemon_request(mp, "persist_progress", inos=inos)
        if st["retrying_in"] and st["last_error"]:
            st["note"] = f"retrying: {st['last_error'][:60]}"
        return st

    st = poll_with_progress("persisting", poll)
    if as_json:
        click.echo(json.dumps({**queued, "persisted_files": st["files_done"],
                               "bytes": st["bytes_total"], "failed": st["failed"]}, indent=2))
    else:
        for path, why in st["failed"].items():
            click.echo(f"mtcfs: {path}: {why}", err=True)
    if st["failed"]:
        fail(f"{plural(len(st['failed']), 'file')} could not be persisted")
    if not as_json:
        click.echo(f"persisted {plural(st['files_done'], 'file')}, "
                   f"{format_size(st['bytes_total'])}", err=True)
