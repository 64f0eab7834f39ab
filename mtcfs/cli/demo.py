"""`mtcfs demo`: the whole story on this machine, with real parts."""

from __future__ import annotations

import click


@click.command("demo")
@click.option("--size", default="256MiB", show_default=True,
              help="approximate checkpoint size to save")
@click.option("--keep", is_flag=True, help="leave the mount up at the end")
def demo(size: str, keep: bool) -> None:
    """Three hosts on this machine (three mounts, three peer ports): each saves a shard
    at RAM speed, shards replicate to peers and persist to a local GCS server, one
    host is killed and a replacement restores its shards from the peers."""
    from mtcfs.cli.demo_run import run_demo
    from mtcfs.config import ConfigError, parse_size

    try:
        nbytes = parse_size(size)
    except ConfigError as e:
        raise click.UsageError(str(e)) from None
    run_demo(nbytes, keep)
