"""Telling the kernel about changes it did not make (another host's, the bucket's,
retention's), so it drops the names and attributes it caches.

A notification can block inside the kernel: invalidating a name takes its
directory's lock, which a FUSE request being served (a rename, a directory
fsync waiting for the peers) may hold. So notifications never run on the trio
thread that serves FUSE: one worker thread sends them in order, and a caller
that wants them to have landed (a peer's broadcast, before it is acknowledged)
waits a bounded time with `settle`. Should a notification be stuck behind such
a lock, the name is still never served stale: a node removed or replaced by a
remote change answers ESTALE, and the kernel looks the path up again.
"""

from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class KernelCache:
    def __init__(self, invalidate_entry: Callable[[int, bytes], None],
                 invalidate_attrs: Callable[[int], None]) -> None:
        self._entry = invalidate_entry
        self._attrs = invalidate_attrs
        # Notifications not taken by the thread yet: it takes them all at once, so a
        # batch of another host's changes wakes it once, not once per name.
        self._pending: list[tuple[int, bytes | None]] = []
        self._stopping = False
        # (target, callback): called from the thread once `target` notifications are done
        self._watchers: list[tuple[int, Callable[[], None]]] = []
        self._issued = 0
        self._done = 0
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self.live = False  # the kernel refuses notifications before INIT

    def start(self) -> None:
        self.live = True
        self._thread = threading.Thread(target=self._run, name="kernel-notify", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            with self._cond:
                self._stopping = True
                self._cond.notify_all()
            self._thread.join(timeout=2)

    def entry(self, parent_ino: int, name: bytes) -> None:
        """Drop the kernel's cached name `name` in directory `parent_ino`."""
        self._put((parent_ino, name))

    def attrs(self, ino: int) -> None:
        """Drop the kernel's cached attributes of `ino`."""
        self._put((ino, None))

    def _put(self, op: tuple[int, bytes | None]) -> None:
        if not self.live:
            return  # before the mount is live the kernel has nothing cached
        with self._cond:
            self._issued += 1
            self._pending.append(op)
            if len(self._pending) == 1:
                self._cond.notify_all()  # (more than one: it is awake already)

    def when_settled(self, callback: Callable[[], None]) -> None:
        """Call `callback` (from the notifying thread, or here if there is nothing to
        wait for) once every notification issued so far has been sent: a wait for
        them that holds no thread."""
        with self._cond:
            if self._done < self._issued:
                self._watchers.append((self._issued, callback))
                return
        callback()

    def settle(self, timeout: float) -> bool:
        """Wait (bounded) until every notification issued so far has been sent.
        Any thread but the one serving FUSE. True when they all landed."""
        with self._cond:
            target = self._issued
            return self._cond.wait_for(lambda: self._done >= target, timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                ops, self._pending = self._pending, []
            for ino, name in ops:
                try:
                    if name is None:
                        self._attrs(ino)
                    else:
                        self._entry(ino, name)
                except OSError as e:
                    if e.errno != errno.ENOENT:  # ENOENT: nothing cached, nothing to do
                        log.debug("kernel notification for %d/%r: %s", ino, name, e)
                except Exception:
                    log.exception("kernel notification for %d/%r failed", ino, name)
            with self._cond:
                self._done += len(ops)
                self._cond.notify_all()
                due = [cb for target, cb in self._watchers if target <= self._done]
                if due:
                    self._watchers = [w for w in self._watchers if w[0] > self._done]
            for callback in due:
                try:
                    callback()
                except Exception:
                    log.exception("kernel notifications: a watcher failed")
