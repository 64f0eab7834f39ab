"""`mtcfs mount`: validate every option before anything is mounted, then run
the daemon (in the foreground, or detached with --daemon)."""

from __future__ import annotations

import sys

import click

from mtcfs.cli.common import usage_error
from mtcfs.config import (
    DATA_PATHS,
    FSYNC_LEVELS,
    HUGE_PAGES,
    LOG_FORMATS,
    LOG_LEVELS,
    VISIBILITY_MODES,
    ConfigError,
    build_options,
)


@click.command("mount")
@click.argument("mountpoint", type=click.Path(file_okay=False))
@click.option("--ram-dir", help="tmpfs directory for file data [default: /dev/shm/mtcfs-<hash>]")
@click.option("--ram-size", help="RAM tier budget, e.g. 512MiB, 8GiB or 64Gi; at least 4MiB, at "
              "most the size of the RAM dir's filesystem  [default: 4GiB, or half that "
              "filesystem if smaller]")
@click.option("--huge-pages", type=click.Choice(HUGE_PAGES, case_sensitive=False),
              help="transparent huge pages for the RAM tier's tmpfs: always, never, or auto: "
                   "a short probe at mount keeps them unless their first touch is slower "
                   "(a VM that returns freed memory to its host)  [default: auto]")
@click.option("--node-id", help="this node's id in the job [default: hostname]")
@click.option("--daemon", is_flag=True, default=None,
              help="detach; return 0 once the mount is live")
@click.option("--log-level", type=click.Choice(LOG_LEVELS, case_sensitive=False))
@click.option("--config", "config_file", type=click.Path(dir_okay=False),
              help="TOML file with the same keys as the long options")
@click.option("-o", "fuse_options", multiple=True, metavar="FUSE_OPTION",
              help="FUSE mount option, e.g. allow_other (repeatable); nonempty: mount over "
                   "a directory that has files (hidden while mounted)")
@click.option("--listen", metavar="HOST:PORT",
              help="address the peer RPC server listens on (and peers reach this node at)")
@click.option("--peers", metavar="ADDR[,ADDR...]", help="the other hosts' --listen addresses")
@click.option("--peers-file", metavar="FILE",
              help="file of peer addresses, one per line (re-read when it changes)")
@click.option("--replicas", type=int, metavar="K",
              help="peer copies of each closed file  [default: 1]")
@click.option("--token-file", metavar="FILE",
              help="shared secret that authenticates peer RPCs (required with peers)")
@click.option("--insecure", is_flag=True, default=None,
              help="allow peers without a token (trusted networks only)")
@click.option("--tls-cert", metavar="FILE", help="TLS certificate for the peer server (PEM)")
@click.option("--tls-key", metavar="FILE", help="its private key (PEM)")
@click.option("--tls-ca", metavar="FILE", help="CA that signed the peers' certificates (PEM)")
@click.option("--failure-domain", metavar="LABEL",
              help="this host's failure domain (e.g. zone); replicas go to other domains first")
@click.option("--data-listen", metavar="HOST:PORT",
              help="where the bulk data channel (file bytes between peers, beside gRPC) "
                   "listens; port 0: any free port  [default: the --listen host, its port + 1]")
@click.option("--data-connections", type=int, metavar="N",
              help="bulk data connections per peer (0: file bytes over gRPC)  [default: 4]")
@click.option("--peer-group", type=int, metavar="N",
              help="hosts per group whose leader carries the group's index changes "
                   "down one tree (0: automatic, about the square root of the hosts, 16 at "
                   "least, from 64 on; 1: every host its own tree)  [default: 0]")
@click.option("--peer-group-turn", type=float, metavar="SECONDS",
              help="another host of each group leads every SECONDS, by the wall clock the "
                   "hosts share (0: the group's first live host, always)  [default: 10]")
@click.option("--open-wait", type=float, metavar="SECONDS",
              help="a reader's open of a file held by a peer waits up to SECONDS for it to "
                   "arrive whole, then reads it in RAM (passthrough): faster whole-file "
                   "restores, but a read of a slice waits too; 0: read it as it arrives, "
                   "through the daemon  [default: 0]")
@click.option("--peer-encryption", is_flag=True, default=None,
              help="encrypt file bytes between peers (AES-GCM; every host alike)  "
                   "[default: authenticated, not encrypted]")
@click.option("--bucket", metavar="URL",
              help="durable tier: gs://bucket[/prefix] or file:///dir")
@click.option("--gcs-endpoint", metavar="URL",
              help="GCS endpoint, e.g. an emulator [default: $STORAGE_EMULATOR_HOST or Google]")
@click.option("--persist", metavar="POLICY",
              help="on-close | step | interval:SECONDS | manual  [default: step]")
@click.option("--list-refresh", type=float, metavar="SECONDS",
              help="re-list the bucket every SECONDS  [default: 30]")
@click.option("--commit-markers", metavar="NAME[,NAME...]",
              help="step commit markers [default: .metadata,_CHECKPOINT_METADATA,"
                   "commit_success.txt]")
@click.option("--tmp-patterns", metavar="PATTERN[,PATTERN...]",
              help="temporary names, never uploaded [default: *.orbax-checkpoint-tmp*,*.tmp]")
@click.option("--keep-steps", type=int, metavar="N",
              help="keep the newest N complete steps in RAM; evict older ones once persisted "
                   "(needs --bucket)")
@click.option("--incomplete-grace", type=float, metavar="SECONDS",
              help="with --keep-steps: remove an incomplete step older than the newest "
                   "complete one after SECONDS without changes  [default: 600]")
@click.option("--full-timeout", type=float, metavar="SECONDS",
              help="a write into a full RAM tier waits this long for data to become "
                   "evictable, then fails with ENOSPC  [default: 60]")
@click.option("--fsync", type=click.Choice(FSYNC_LEVELS, case_sensitive=False),
              help="fsync() returns once the file is in RAM (local), in K peer copies "
                   "(replicas) or persisted (gcs)  [default: local]")
@click.option("--fsync-timeout", type=float, metavar="SECONDS",
              help="fsync() fails with EIO if its level is not reached in time  [default: 300]")
@click.option("--commit-timeout", type=float, metavar="SECONDS",
              help="fsync(), and the rename or close that commits a step, return once every "
                   "live peer has applied the change, or after SECONDS (logged)  [default: 10]")
@click.option("--visibility", type=click.Choice(VISIBILITY_MODES, case_sensitive=False),
              help="fsync: plain close() returns at once and reaches peers in the background "
                   "(in a step being written, under a temporary name, it waits for them); "
                   "close: every close() also waits for the peers  [default: fsync]")
@click.option("--data-path", type=click.Choice(DATA_PATHS, case_sensitive=False),
              help="passthrough: the kernel reads and writes files in the RAM tier without "
                   "the daemon (Linux >= 6.9, CAP_SYS_ADMIN); fuse: every byte passes the "
                   "daemon; auto: passthrough where it works  [default: auto]")
@click.option("--metrics-port", type=int, metavar="PORT",
              help="serve Prometheus metrics at /metrics and /healthz on PORT")
@click.option("--metrics-address", metavar="ADDR",
              help="address the metrics server binds  [default: 0.0.0.0]")
@click.option("--log-format", type=click.Choice(LOG_FORMATS, case_sensitive=False),
              help="text, or json: one JSON object per line (Cloud Logging)  [default: text]")
def mount(mountpoint: str, config_file: str | None, **cli: object) -> None:
    """Mount mtcfs at MOUNTPOINT (stays in the foreground unless --daemon)."""
    from mtcfs import daemon  # heavy imports only when mounting

    try:
        opts = build_options(mountpoint, cli, config_file)
    except ConfigError as e:
        usage_error(str(e))
    sys.exit(daemon.run(opts))
