"""Mount options: parsing, validation and the TOML config file.

Every option of `mtcfs mount` can also be set in a TOML file given with
`--config`; keys are the long option names (`ram-size` or `ram_size`).
Command-line values win over the file.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import socket
import time
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path

from mtcfs import sizes
from mtcfs.peer import addresses
from mtcfs.peer.addresses import AddressError

# Re-exported: tests and benchmarks import the probes from here.
from mtcfs.probes import (  # noqa: F401
    is_dead_mount,
    is_mounted,
    mount_entry,
    process_alive,
    release_dead_listener,
)
from mtcfs.sizes import SizeError, format_size

log = logging.getLogger("mtcfs")

FSYNC_LEVELS = ("local", "replicas", "gcs")
VISIBILITY_MODES = ("fsync", "close")
DATA_PATHS = ("auto", "passthrough", "fuse")
LOG_FORMATS = ("text", "json")
HUGE_PAGES = ("auto", "always", "never")

# Below this a RAM tier holds nothing useful: `--ram-size 1` (meant as GiB?) is refused.
MIN_RAM_SIZE = 4 << 20

# Mount options libfuse and the kernel accept (checked before mounting so a
# typo is a usage error, not a failed mount).
FUSE_OPTIONS = frozenset({
    "allow_other", "allow_root", "auto_unmount", "default_permissions", "ro", "rw",
    "atime", "noatime", "relatime", "strictatime", "nodiratime", "exec", "noexec",
    "nosuid", "nodev", "sync", "async", "dirsync", "fsname", "subtype", "max_read",
    "blksize", "context", "fscontext", "defcontext", "rootcontext",
})
# mtcfs's own -o options, never passed to the kernel: nonempty mounts over a directory
# that has files (they stay hidden while mounted).
OWN_MOUNT_OPTIONS = frozenset({"nonempty"})

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


class ConfigError(ValueError):
    """Bad user input; the CLI turns it into exit status 2 and one line on stderr."""


def parse_size(text: str | int) -> int:
    try:
        return sizes.parse_size(text)
    except SizeError as e:
        raise ConfigError(str(e)) from None


def default_ram_dir(mountpoint: str) -> str:
    """A private tmpfs directory derived from the mountpoint, so a restarted
    daemon for the same mountpoint finds (re-adopts) the data it had."""
    digest = hashlib.sha256(os.path.realpath(mountpoint).encode()).hexdigest()[:12]
    return f"/dev/shm/mtcfs-{digest}"


@dataclass
class MountOptions:
    mountpoint: str
    ram_dir: str = ""
    ram_size: int = 0
    node_id: str = ""
    daemon: bool = False
    log_level: str = "info"
    fuse_options: list[str] = field(default_factory=list)
    # The peer tier (docs/peers.md).
    listen: str | None = None
    peers: str | None = None
    peers_file: str | None = None
    replicas: int | None = None
    token_file: str | None = None
    insecure: bool = False
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    failure_domain: str | None = None
    # The bulk data channel (mtcfs.peer.bulk): where it listens, connections per peer.
    data_listen: str | None = None
    data_connections: int = 4
    # Hosts per group whose leader carries the group's index batches down one
    # tree (mtcfs.peer.grouped): 0 automatic (about sqrt(N) from 64 hosts), 1 none.
    peer_group: int = 0
    # Another host of each group leads every this many seconds (0: the first, always).
    peer_group_turn: float = 10.0
    # A reader's open of a file a peer holds waits this long for it to arrive whole
    # (then read through passthrough), else reads it as it arrives (0: at once).
    open_wait: float = 0.0
    # AES-GCM encryption of the data channel's frames (else authenticated only).
    peer_encryption: bool = False
    bucket: str | None = None
    gcs_endpoint: str | None = None
    persist: str | None = None
    list_refresh: float = 30.0
    commit_markers: str | None = None
    tmp_patterns: str | None = None
    # Lifecycle (mtcfs.lifecycle): retention, space, durability; observability.
    keep_steps: int | None = None
    incomplete_grace: float = 600.0
    full_timeout: float = 60.0
    fsync: str = "local"
    fsync_timeout: float = 300.0
    # What fsync/commit/close wait for: every live peer has applied the change.
    commit_timeout: float = 10.0
    visibility: str = "fsync"
    # passthrough: the kernel reads and writes RAM-tier files without the daemon.
    data_path: str = "auto"
    metrics_port: int | None = None
    metrics_address: str = "0.0.0.0"
    log_format: str = "text"
    # The RAM tier's tmpfs: transparent huge pages (auto: probed at mount).
    huge_pages: str = "auto"
    # Not an option: validation created the RAM dir (a failed mount removes it again).
    ram_dir_created: bool = field(default=False, metadata={"option": False})

    @property
    def control_socket(self) -> str:
        return os.path.join(self.ram_dir, "control.sock")


def load_toml(path: str) -> dict[str, object]:
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"config file {path}: {e}") from None
    known = {f.name for f in fields(MountOptions)
             if f.metadata.get("option", True)} - {"mountpoint"}
    out: dict[str, object] = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name == "o":
            name = "fuse_options"
        if name not in known:
            raise ConfigError(f"config file {path}: unknown key {key!r}")
        _check_toml_type(path, key, name, value)
        out[name] = value
    return out


def _check_toml_type(path: str, key: str, name: str, value: object) -> None:
    """TOML values have types: `daemon = "no"` must not mean true."""
    if name in ("daemon", "insecure", "peer_encryption"):
        ok, want = isinstance(value, bool), "true or false"
    elif name in ("replicas", "keep_steps", "metrics_port", "data_connections",
                  "peer_group"):
        ok, want = isinstance(value, int) and not isinstance(value, bool), "an integer"
    elif name in ("incomplete_grace", "full_timeout", "fsync_timeout", "list_refresh",
                  "commit_timeout", "open_wait", "peer_group_turn"):
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        want = "a number of seconds"
    elif name == "ram_size":
        ok = isinstance(value, str | int | float) and not isinstance(value, bool)
        want = 'a size such as "8GiB" or a number of bytes'
    elif name == "fuse_options":
        ok = isinstance(value, str) or (
            isinstance(value, list) and all(isinstance(v, str) for v in value))
        want = "a string or a list of strings"
    else:
        ok, want = isinstance(value, str), "a string"
    if not ok:
        raise ConfigError(f"config file {path}: {key} must be {want}, not {value!r}")


def build_options(mountpoint: str, cli: dict[str, object], config_file: str | None) -> MountOptions:
    """Merge the config file and the command line (command line wins), then validate."""
    values: dict[str, object] = load_toml(config_file) if config_file else {}
    for key, value in cli.items():
        if value is not None and value != () and value is not False:
            values[key] = value
    if isinstance(values.get("fuse_options"), tuple | str):
        fo = values["fuse_options"]
        values["fuse_options"] = [fo] if isinstance(fo, str) else list(fo)
    opts = MountOptions(mountpoint=os.path.abspath(mountpoint))
    for key, value in values.items():
        setattr(opts, key, value)
    _validate(opts)
    return opts


def _validate(opts: MountOptions) -> None:
    explicit_ram_size = bool(opts.ram_size)
    given = opts.ram_size
    opts.ram_size = parse_size(opts.ram_size or "4GiB")
    if opts.ram_size < MIN_RAM_SIZE:
        raise ConfigError(f"invalid --ram-size {given!r}: at least "
                          f"{format_size(MIN_RAM_SIZE)} (give a unit, e.g. 8GiB or 64Gi)")
    opts.huge_pages = _choice(opts.huge_pages, "auto", HUGE_PAGES, "--huge-pages")
    _validate_durable(opts)
    _validate_peers(opts)
    _validate_lifecycle(opts)
    opts.log_level = str(opts.log_level).lower()
    if opts.log_level not in LOG_LEVELS:
        raise ConfigError(
            f"invalid log level {opts.log_level!r}: choose one of {', '.join(LOG_LEVELS)}"
        )
    _validate_data_path(opts)
    opts.node_id = str(opts.node_id or socket.gethostname())
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}", opts.node_id):
        raise ConfigError(
            f"invalid node id {opts.node_id!r}: use letters, digits, '.', '_' or '-' (max 63)"
        )
    opts.ram_dir = os.path.abspath(opts.ram_dir or default_ram_dir(opts.mountpoint))
    for o in opts.fuse_options:
        if not re.fullmatch(r"[A-Za-z0-9_]+(=[^,]*)?", o):
            raise ConfigError(f"invalid FUSE option {o!r}")
        key = o.split("=", 1)[0]
        if key not in FUSE_OPTIONS | OWN_MOUNT_OPTIONS and o not in ("suid", "dev"):
            raise ConfigError(
                f"unknown FUSE option {o!r}: use one of {', '.join(sorted(FUSE_OPTIONS))}"
            )
        if o in ("suid", "dev"):
            # The daemon does not clear setuid bits or capabilities on write
            # (the kernel leaves that to it under HANDLE_KILLPRIV_V2).
            raise ConfigError(f"FUSE option {o!r} is not allowed: mtcfs mounts are nosuid,nodev")
    check_mountpoint(opts.mountpoint, nonempty="nonempty" in opts.fuse_options)
    check_ports(opts)
    opts.ram_dir_created = check_ram_dir(opts.ram_dir, opts.mountpoint)
    try:
        _check_ram_size(opts, explicit_ram_size)
    except ConfigError:
        if opts.ram_dir_created:  # refused: nothing left behind
            os.rmdir(opts.ram_dir)
        raise


def _check_ram_size(opts: MountOptions, explicit_ram_size: bool) -> None:
    """The budget fits what holds it: memory (the RAM tier's own tmpfs) or the
    filesystem of the RAM dir."""
    st = os.statvfs(opts.ram_dir)
    if opts.data_path != "fuse" and passthrough_unavailable() is None:
        # The RAM tier becomes a tmpfs of its own: bounded by memory, not by the
        # filesystem the RAM dir is on.
        _check_ram_size_against_memory(opts, explicit_ram_size)
        return
    if not explicit_ram_size:
        # The default must fit small /dev/shm's (containers): at most half of it.
        opts.ram_size = min(opts.ram_size, st.f_blocks * st.f_frsize // 2)
    if opts.ram_size > st.f_blocks * st.f_frsize:
        # The budget would be charged for space tmpfs cannot give: writes (and the
        # metadata store) would hit ENOSPC before eviction could help.
        raise ConfigError(
            f"--ram-size {format_size(opts.ram_size)} is larger than the filesystem holding "
            f"the RAM dir {opts.ram_dir} ({format_size(st.f_blocks * st.f_frsize)}): lower it "
            "or give a larger --ram-dir (e.g. remount /dev/shm with size=...)")


def _choice(value: object, default: str, choices: Sequence[str], option: str) -> str:
    """An option's value, lower-cased, among `choices` (ConfigError naming them)."""
    chosen = str(value or default).lower()
    if chosen not in choices:
        raise ConfigError(f"invalid {option} {chosen!r}: choose one of {', '.join(choices)}")
    return chosen


def _validate_data_path(opts: MountOptions) -> None:
    opts.data_path = _choice(opts.data_path, "auto", DATA_PATHS, "--data-path")
    if opts.data_path == "passthrough":
        why = passthrough_unavailable()
        if why is not None:
            raise ConfigError(f"--data-path passthrough: {why}; use --data-path auto or fuse")


def passthrough_unavailable() -> str | None:
    from mtcfs.fs.passthrough import unavailable

    return unavailable()


def _check_ram_size_against_memory(opts: MountOptions, explicit: bool) -> None:
    total = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                total = int(line.split()[1]) * 1024
    if not explicit:
        opts.ram_size = min(opts.ram_size, total // 2)
    if total and opts.ram_size > total:
        raise ConfigError(f"--ram-size {format_size(opts.ram_size)} is larger than this "
                          f"machine's memory ({format_size(total)})")


def _validate_durable(opts: MountOptions) -> None:
    from mtcfs.persist.policy import PersistPolicy

    for name in ("commit_markers", "tmp_patterns"):
        value = getattr(opts, name)
        if value is not None and not [v for v in str(value).split(",") if v.strip()]:
            raise ConfigError(f"--{name.replace('_', '-')} needs at least one name")
    if opts.bucket is None:
        for name in ("gcs_endpoint", "persist"):
            if getattr(opts, name) is not None:
                flag = "--" + name.replace("_", "-")
                raise ConfigError(f"{flag} needs --bucket")
        return
    if not opts.bucket.startswith(("gs://", "file://")):
        raise ConfigError(f"invalid --bucket {opts.bucket!r}: use gs://bucket[/prefix] or "
                          "file:///dir")
    from mtcfs.tiers.durable import DurableError, parse_url

    try:
        parse_url(opts.bucket)
    except DurableError as e:
        raise ConfigError(str(e)) from None
    opts.persist = opts.persist or "step"
    try:
        PersistPolicy.parse(opts.persist)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    try:
        opts.list_refresh = float(opts.list_refresh)
    except (TypeError, ValueError):
        raise ConfigError(f"invalid --list-refresh {opts.list_refresh!r}: seconds") from None
    if opts.list_refresh <= 0:
        raise ConfigError("--list-refresh must be greater than zero")


def _seconds(opts: MountOptions, name: str, allow_zero: bool = False) -> float:
    flag = "--" + name.replace("_", "-")
    try:
        value = float(getattr(opts, name))
    except (TypeError, ValueError):
        raise ConfigError(f"invalid {flag} {getattr(opts, name)!r}: a number of seconds") from None
    if value < 0 or (value == 0 and not allow_zero) or value != value:
        raise ConfigError(f"invalid {flag} {value:g}: must be greater than zero")
    setattr(opts, name, value)
    return value


def _validate_lifecycle(opts: MountOptions) -> None:
    if opts.keep_steps is not None:
        if isinstance(opts.keep_steps, bool) or not isinstance(opts.keep_steps, int) \
                or opts.keep_steps < 1:
            raise ConfigError(f"invalid --keep-steps {opts.keep_steps!r}: a number >= 1")
        if opts.bucket is None:
            # Retention drops every RAM copy of an older step: only safe when
            # the step is in the durable tier.
            raise ConfigError("--keep-steps needs --bucket: older steps are evicted from RAM "
                              "once persisted, and without a durable tier nothing would be left")
    _seconds(opts, "incomplete_grace", allow_zero=True)
    _seconds(opts, "full_timeout", allow_zero=True)
    _seconds(opts, "open_wait", allow_zero=True)
    _seconds(opts, "peer_group_turn", allow_zero=True)
    _seconds(opts, "fsync_timeout")
    _seconds(opts, "commit_timeout")
    opts.visibility = _choice(opts.visibility, "fsync", VISIBILITY_MODES, "--visibility")
    opts.fsync = _choice(opts.fsync, "local", FSYNC_LEVELS, "--fsync")
    if opts.fsync == "replicas" and not (opts.listen and opts.replicas):
        raise ConfigError("--fsync replicas needs peers (--listen, --peers) and --replicas >= 1")
    if opts.fsync == "gcs" and opts.bucket is None:
        raise ConfigError("--fsync gcs needs --bucket")
    if opts.metrics_port is not None and (
            isinstance(opts.metrics_port, bool) or not isinstance(opts.metrics_port, int)
            or not 0 <= opts.metrics_port < 65536):
        raise ConfigError(f"invalid --metrics-port {opts.metrics_port!r}: a port 0-65535 "
                          "(0 picks a free one)")
    opts.log_format = str(opts.log_format or "text").lower()
    if opts.log_format not in LOG_FORMATS:
        raise ConfigError(f"invalid --log-format {opts.log_format!r}: text or json")


def parse_address(text: str, what: str) -> tuple[str, int]:
    try:
        return addresses.parse_address(text, what)
    except AddressError as e:
        raise ConfigError(str(e)) from None


def read_peers_file(path: str) -> list[str]:
    try:
        return addresses.read_peers_file(path)
    except AddressError as e:
        raise ConfigError(str(e)) from None


def read_token(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            token = f.read().strip()
    except OSError as e:
        raise ConfigError(f"token file {path}: {e.strerror}") from None
    if len(token) < 16:
        raise ConfigError(f"token file {path}: the token must be at least 16 bytes")
    return token


def _validate_peers(opts: MountOptions) -> None:
    peered = bool(opts.listen or opts.peers or opts.peers_file)
    if not peered:
        for name in ("replicas", "token_file", "tls_cert", "tls_key", "tls_ca", "failure_domain",
                     "data_listen"):
            if getattr(opts, name) is not None:
                flag = "--" + name.replace("_", "-")
                raise ConfigError(f"{flag} needs --listen and --peers or --peers-file")
        return
    if not opts.listen:
        raise ConfigError("--peers needs --listen HOST:PORT (the address peers reach this node at)")
    parse_address(opts.listen, "--listen address")
    if opts.peers:
        for a in str(opts.peers).split(","):
            if a.strip():
                parse_address(a, "peer address")
    if opts.peers_file:
        opts.peers_file = os.path.abspath(opts.peers_file)
        read_peers_file(opts.peers_file)
    if opts.token_file:
        opts.token_file = os.path.abspath(opts.token_file)
        read_token(opts.token_file)
    elif not opts.insecure:
        raise ConfigError("peers need a shared secret: give --token-file FILE "
                          "(or --insecure to run unauthenticated on a trusted network)")
    if opts.replicas is None:
        opts.replicas = 1
    if not isinstance(opts.replicas, int) or opts.replicas < 0:
        raise ConfigError(f"invalid --replicas {opts.replicas!r}: a number >= 0")
    if opts.data_listen is not None:
        data_listen_address(opts)  # raises on a malformed address
    if (not isinstance(opts.data_connections, int) or isinstance(opts.data_connections, bool)
            or not 0 <= opts.data_connections <= 64):
        raise ConfigError(f"invalid --data-connections {opts.data_connections!r}: 0-64")
    if (not isinstance(opts.peer_group, int) or isinstance(opts.peer_group, bool)
            or not 0 <= opts.peer_group <= 1024):
        raise ConfigError(f"invalid --peer-group {opts.peer_group!r}: 0-1024 "
                          "(0: automatic, 1: no groups)")
    if opts.peer_encryption and not opts.data_connections and not opts.tls_cert:
        raise ConfigError("--peer-encryption encrypts the data channel: it needs "
                          "--data-connections >= 1 (or TLS with --tls-cert/--tls-key)")
    tls = [opts.tls_cert, opts.tls_key]
    if any(tls) and not all(tls):
        raise ConfigError("TLS needs both --tls-cert and --tls-key")
    for name in ("tls_cert", "tls_key", "tls_ca"):
        path = getattr(opts, name)
        if path is not None:
            if not os.path.isfile(path):
                raise ConfigError(f"--{name.replace('_', '-')} {path}: no such file")
            setattr(opts, name, os.path.abspath(path))


def data_listen_address(opts: MountOptions) -> tuple[str, int]:
    """Where the bulk data channel listens: --data-listen (port 0: any free port), else
    the --listen host at the next port. Peers learn the port from health checks and
    dial it at the host of our --listen address."""
    if opts.data_listen:
        text = opts.data_listen.strip()
        if text.endswith(":0"):  # parse_address wants 1-65535; 0 means "any"
            host, _ = parse_address(text[:-1] + "1", "--data-listen address")
            return host, 0
        return parse_address(text, "--data-listen address")
    host, port = parse_address(opts.listen or "", "--listen address")
    if port >= 65535:
        raise ConfigError("--listen port 65535 leaves no port for the data channel: "
                          "give --data-listen")
    return host, port + 1


def check_ports(opts: MountOptions) -> None:
    """The ports are free before anything is mounted: --metrics-port, the peers' gRPC
    and gossip port (--listen) and the data channel's (--data-listen, by default the
    --listen port + 1). Checked, not held: the daemon binds them moments later."""
    if opts.metrics_port:
        _check_free(opts.metrics_address, opts.metrics_port, socket.SOCK_STREAM,
                    f"--metrics-port {opts.metrics_port}")
    if not opts.listen:
        return
    host, port = parse_address(opts.listen, "--listen address")
    try:
        _check_free(host, port, socket.SOCK_STREAM, f"--listen {opts.listen}")
    except ConfigError:
        # A killed predecessor stuck on its own mount holds it: release it, once.
        done = release_dead_listener(opts.listen)
        if done is None:
            raise
        log.warning("--listen %s: %s", opts.listen, done)
        deadline = time.monotonic() + 10
        while True:
            try:
                _check_free(host, port, socket.SOCK_STREAM, f"--listen {opts.listen}")
                break
            except ConfigError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
    _check_free(host, port, socket.SOCK_DGRAM, f"--listen {opts.listen} (UDP, membership)")
    if opts.data_connections:
        dhost, dport = data_listen_address(opts)
        if dport:
            what = (f"--data-listen {opts.data_listen}" if opts.data_listen else
                    f"the data channel's port {dport} (the --listen port + 1; give "
                    "--data-listen HOST:PORT to choose another)")
            _check_free(dhost, dport, socket.SOCK_STREAM, what)


def _check_free(host: str, port: int, kind: int, what: str) -> None:
    try:
        infos = socket.getaddrinfo(host, port, type=kind, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ConfigError(f"{what}: cannot resolve {host}: {e.strerror}") from None
    for family, _, _, _, addr in infos:
        with socket.socket(family, kind) as s:
            if kind == socket.SOCK_STREAM:  # as the servers do: TIME_WAIT is no conflict
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(addr)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise ConfigError(f"{what}: port {port} is already in use") from None
                raise ConfigError(f"{what}: cannot bind port {port}: {e.strerror}") from None


def check_mountpoint(mountpoint: str, nonempty: bool = False) -> None:
    p = Path(mountpoint)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise ConfigError(f"mountpoint {mountpoint} does not exist") from None
    except OSError as e:
        # ENOTCONN: a mount whose daemon died; the mount step cleans it up.
        if e.errno == 107:
            return
        raise ConfigError(f"mountpoint {mountpoint}: {e.strerror}") from None
    if not p.is_dir():
        raise ConfigError(f"mountpoint {mountpoint} is not a directory")
    if is_mounted(mountpoint):
        if is_dead_mount(mountpoint):
            return  # its daemon died; the mount step cleans it up
        raise ConfigError(f"mountpoint {mountpoint} is already in use by another mount")
    del st
    if not nonempty:
        try:
            with os.scandir(mountpoint) as it:
                first = next(it, None)
        except OSError as e:
            raise ConfigError(f"mountpoint {mountpoint}: {e.strerror}") from None
        if first is not None:
            raise ConfigError(f"mountpoint {mountpoint} is not empty ({first.name!r} and maybe "
                              "more would be hidden while mounted): empty it, or give "
                              "-o nonempty")


def check_ram_dir(ram_dir: str, mountpoint: str) -> bool:
    """Create the RAM dir if needed (returns whether it did) and check it is usable."""
    real = os.path.realpath(ram_dir)
    mp = os.path.realpath(mountpoint)
    if real == mp or real.startswith(mp + os.sep):
        raise ConfigError(f"RAM dir {ram_dir} must not be inside the mountpoint")
    created = not os.path.lexists(ram_dir)
    try:
        os.makedirs(ram_dir, mode=0o700, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"RAM dir {ram_dir} cannot be created: {e.strerror}") from None
    if not os.path.isdir(ram_dir):
        raise ConfigError(f"RAM dir {ram_dir} is not a directory")
    probe = os.path.join(ram_dir, f".probe-{os.getpid()}")
    try:
        with open(probe, "wb") as f:
            f.write(b"x")
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"RAM dir {ram_dir} is not writable: {e.strerror}") from None
    return created
