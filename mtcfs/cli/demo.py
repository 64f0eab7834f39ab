"""`mtcfs demo`: the whole story on this machine, with real parts."""

from __future__ import annotations

import click


@click.command("demo")
@click.option("--size", default="256MiB", show_default=True,
              help="approximate checkpoint size to save")
@click.option("--keep", is_flag=True, help="leave the mount up at the end")
def demo(size: str, keep: bool) -> None:
    """Save a checkpoint at RAM speed, persist it to a local GCS server, wipe the RAM
    tier and restore it from the bucket (all real parts, on this machine)."""
    from mtcfs.config import ConfigError, parse_size
    from mtcfs.demo import run_demo

    try:
        nbytes = parse_size(size)
    except ConfigError as e:
        raise click.UsageError(str(e)) from None
    run_demo(nbytes, keep)
