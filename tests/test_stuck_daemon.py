"""A killed daemon that cannot finish dying (its invalidation thread waits in the
kernel for a directory lock that a caller's request holds, and that request waits for
the dead daemon's answer) keeps its ports bound: the next daemon on the same --listen
address aborts the recorded FUSE connection of the dead one (mtcfs.probes). Found by a
30-minute chaos run (kill -9 during a create) and released by hand with this code
there; this checks the record, that a live daemon is left alone, and that a dead one's
release is harmless."""

from __future__ import annotations

import json
import os
import signal
import socket

from mtcfs.probes import _record_path, release_dead_listener

from support.mounts import free_port


def test_a_daemon_records_its_listen_address_and_fuse_connection(make_mount) -> None:
    listen = f"127.0.0.1:{free_port()}"
    m = make_mount(extra=("--listen", listen, "--insecure", "--data-listen", "127.0.0.1:0"))
    with open(_record_path(listen)) as f:
        rec = json.load(f)
    assert rec["pid"] == m.proc.pid
    assert rec["fuse_connection"] == os.minor(os.stat(m.path).st_dev)
    assert os.path.isdir(f"/sys/fs/fuse/connections/{rec['fuse_connection']}") or not \
        os.listdir("/sys/fs/fuse/connections")
    assert release_dead_listener(listen) is None  # alive: left alone
    m.proc.send_signal(signal.SIGKILL)
    m.proc.wait(timeout=30)
    # Dead: its connection (still there while the dead mount is) is aborted, which
    # changes nothing for a daemon that died cleanly; the port is free.
    done = release_dead_listener(listen)
    assert done is None or f"dead daemon {rec['pid']}" in done
    host, port = listen.rsplit(":", 1)
    with socket.socket() as s:
        s.bind((host, int(port)))
