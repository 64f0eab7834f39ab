"""The `mtcfs` command (docs/usage.md)."""

from __future__ import annotations

import sys

import click

from mtcfs import __version__
from mtcfs.cli.controller import controller
from mtcfs.cli.csi import csi
from mtcfs.cli.demo import demo
from mtcfs.cli.discover import discover
from mtcfs.cli.mount import mount
from mtcfs.cli.persist import persist
from mtcfs.cli.prefetch import prefetch
from mtcfs.cli.status import status
from mtcfs.cli.steps import steps
from mtcfs.cli.umount import umount

_LATER: dict[str, str] = {}


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="mtcfs")
def cli() -> None:
    """mtcfs: a multi-tier checkpoint filesystem (RAM, peers, GCS) for ML training."""


cli.add_command(mount)
cli.add_command(umount)
cli.add_command(status)
cli.add_command(demo)
cli.add_command(persist)
cli.add_command(steps)
cli.add_command(prefetch)
cli.add_command(csi)
cli.add_command(controller)
cli.add_command(discover)


def _not_yet(name: str, why: str) -> click.Command:
    @click.command(name, help=f"[not yet supported: {why}]",
                   context_settings={"ignore_unknown_options": True})
    @click.argument("args", nargs=-1, type=click.UNPROCESSED)
    def cmd(args: tuple[str, ...]) -> None:
        click.echo(f"mtcfs: error: 'mtcfs {name}' is not yet supported by this version "
                   f"({why})", err=True)
        sys.exit(2)

    return cmd


for _name, _why in _LATER.items():
    cli.add_command(_not_yet(_name, _why))


def main() -> None:
    # Usage errors: one line naming the cause, exit status 2.
    try:
        cli.main(prog_name="mtcfs", standalone_mode=False)
    except click.UsageError as e:
        cmd = f" {e.ctx.info_name}" if e.ctx and e.ctx.parent else ""
        click.echo(f"mtcfs{cmd}: error: {e.format_message()} (see --help)", err=True)
        sys.exit(2)
    except click.ClickException as e:
        click.echo(f"mtcfs: error: {e.format_message()}", err=True)
        sys.exit(e.exit_code)
    except click.Abort:
        click.echo("mtcfs: aborted", err=True)
        sys.exit(1)
