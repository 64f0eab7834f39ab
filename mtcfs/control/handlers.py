"""What the daemon answers on its control socket (see mtcfs.control).

Every request returns at once: long operations (persist, umount --wait) are started
here and their progress is polled by the CLI, which draws the progress bar.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mtcfs.core.namespace import CLOSED, ROOT, Inode
from mtcfs.core.steps import files_under
from mtcfs.status import mount_status

if TYPE_CHECKING:
    from mtcfs.assembly import Mount

Reply = dict[str, Any]


class ControlHandler:
    """`metrics_url`: where the metrics are served (None without --metrics-port)."""

    def __init__(self, mount: Mount, shutdown: Callable[[], None],
                 metrics_url: str | None = None) -> None:
        self.mount = mount
        self.ns = mount.ns
        self.shutdown = shutdown
        self.metrics_url = metrics_url

    async def __call__(self, req: dict[str, Any]) -> Reply:
        op = req.get("op")
        handler = getattr(self, f"op_{op}", None) if isinstance(op, str) else None
        if handler is None:
            return {"ok": False, "error": f"unknown request {op!r}"}
        return handler(req)

    def op_status(self, req: dict[str, Any]) -> Reply:
        return {"ok": True, "status": mount_status(self.mount, self.metrics_url)}

    def op_shutdown(self, req: dict[str, Any]) -> Reply:
        self.shutdown()
        return {"ok": True}

    # -- persist ------------------------------------------------------------------

    def _resolve(self, paths: list[str]) -> list[Inode]:
        """Files named by mount-relative paths (directories: every file below)."""
        ns = self.ns
        out: list[Inode] = []
        for p in paths or [""]:
            node = ns.inodes[ROOT]
            for comp in [c for c in p.split("/") if c and c != "."]:
                child = ns.child(node, comp.encode("utf-8", "surrogateescape")) \
                    if node.is_dir else None
                if child is None:
                    raise FileNotFoundError(f"{p}: no such file or directory in the mount")
                node = child
            out.extend(files_under(ns, node) if node.is_dir else [node])
        return out

    def op_persist(self, req: dict[str, Any]) -> Reply:
        up = self.mount.uploader
        if not self.mount.opts.bucket:
            return {"ok": False, "error": "this mount has no durable tier (mount with --bucket)"}
        try:
            nodes = self._resolve([str(p) for p in req.get("paths") or []])
        except FileNotFoundError as e:
            return {"ok": False, "error": str(e)}
        files = [n for n in nodes if n.state == CLOSED]
        skipped = len(nodes) - len(files)
        up.request(files)
        return {"ok": True, "inos": [n.ino for n in files], "skipped_open": skipped,
                "files": len(files), "bytes": sum(n.size for n in files)}

    def op_persist_progress(self, req: dict[str, Any]) -> Reply:
        up = self.mount.uploader
        if not self.mount.opts.bucket:
            return {"ok": False, "error": "this mount has no durable tier"}
        nodes = [n for ino in req.get("inos") or [] if (n := self.ns.get(int(ino)))]
        live = [n for n in nodes if n.linked]
        done = [n for n in live if n.persisted]
        failed = {self.ns.path_of(n): up.failed[n.ino] for n in live if n.ino in up.failed}
        # A file that is neither done, queued, in flight nor failed was changed
        # again (its next seal queues it) or removed: it no longer counts.
        waiting = [n for n in live if not n.persisted and n.ino not in up.failed]
        return {
            "ok": True,
            "files_total": len(live),
            "files_done": len(done),
            "bytes_total": sum(n.size for n in live),
            "bytes_done": sum(n.size for n in done) + min(
                up.stats.inflight_bytes_done, sum(n.size for n in waiting)),
            "failed": failed,
            "last_error": up.stats.last_error or None,
            "retrying_in": up.status()["retrying_in"],
            "finished": not waiting,
        }

    # -- prefetch -----------------------------------------------------------------

    def op_prefetch(self, req: dict[str, Any]) -> Reply:
        m = self.mount
        rt = m.fetcher
        if req.get("restore"):  # the background restore's files (a replacement host)
            files = m.restore.files
            missing = [n for n in files if not n.has_data]
            return {"ok": True, "inos": [n.ino for n in files], "files": len(files),
                    "bytes": sum(n.size for n in files), "to_fetch": len(missing),
                    "bytes_to_fetch": sum(n.size for n in missing)}
        try:
            nodes = self._resolve([str(p) for p in req.get("paths") or []])
        except FileNotFoundError as e:
            return {"ok": False, "error": str(e)}
        files = [n for n in nodes if n.state == CLOSED]
        missing = [n for n in files if not n.has_data]
        need = sum(n.size for n in missing)
        free = m.ram.free
        if missing and not (m.opts.listen or m.opts.bucket):
            return {"ok": False, "error": "this mount has no peers and no durable tier to "
                                          "fetch from"}
        if need > free:
            return {"ok": False, "error": f"the RAM tier cannot hold it: {need} bytes to fetch, "
                                          f"{free} free (--ram-size)"}
        if missing:
            rt.prefetch(missing, parallel=int(req.get("parallel") or 4))
        return {"ok": True, "inos": [n.ino for n in files], "files": len(files),
                "bytes": sum(n.size for n in files), "to_fetch": len(missing),
                "bytes_to_fetch": need}

    def op_prefetch_progress(self, req: dict[str, Any]) -> Reply:
        rt = self.mount.fetcher
        nodes = [n for ino in req.get("inos") or [] if (n := self.ns.get(int(ino)))]
        live = [n for n in nodes if n.linked]
        errors = {**rt.prefetch_errors, **self.mount.restore.failed}
        failed = {self.ns.path_of(n): errors[n.ino] for n in live if n.ino in errors}
        done = [n for n in live if n.has_data]
        return {
            "ok": True,
            "files_total": len(live),
            "files_done": len(done),
            "bytes_total": sum(n.size for n in live),
            "bytes_done": sum(rt.fetched_bytes(n) for n in live),
            "failed": failed,
            "sources": dict(rt.sources),
            "finished": all(n.has_data or n.ino in errors for n in live),
        }

    # -- steps --------------------------------------------------------------------

    def op_steps(self, req: dict[str, Any]) -> Reply:
        return {"ok": True, **self.mount.step_report.steps()}
