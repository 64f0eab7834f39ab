"""What is known of each checkpoint step: complete, safe, persisted, withdrawn, where its
copies are. One view, read by `mtcfs steps`, by `user.mtcfs.state` on a step directory
and by the status (the newest safe step)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from mtcfs.core.namespace import CLOSED, Inode, Namespace
from mtcfs.core.steps import StepRules, all_steps, files_under, is_step, step_number

if TYPE_CHECKING:
    from mtcfs.core.copies import Copies


class Kept(Protocol):
    """Retention (absent.NoRetention without --keep-steps)."""

    keep: int | None

    def kept(self) -> set[int]: ...


class Losses(Protocol):
    """Withdrawal (absent.NoWithdrawal without peers)."""

    def lost(self, f: Inode) -> bool: ...

    def is_withdrawn(self, d: Inode) -> bool: ...


class StepReport:
    """`durable_url`: the durable tier's URL, None without one."""

    def __init__(self, ns: Namespace, rules: StepRules, copies: Copies,
                 durable_url: str | None, retention: Kept, withdrawal: Losses) -> None:
        self.ns = ns
        self.rules = rules
        self.copies = copies
        self.durable_url = durable_url
        self.retention = retention
        self.withdrawal = withdrawal

    def _kept(self) -> set[int]:
        return self.retention.kept()

    def entry(self, d: Inode, kept: set[int], with_files: bool = True) -> dict[str, Any]:
        """One step directory as `mtcfs steps --json` lists it."""
        ns, copies, k = self.ns, self.copies, self.copies.replicas
        files = [f for f in files_under(ns, d) if f.linked]
        complete = self.rules.is_committed_step(ns, d)
        replicas = [copies.replicas_of(f) if f.state == CLOSED else 0 for f in files]
        # Safe: every file persisted, or in K peer copies.
        safe = complete and bool(files) and all(
            f.persisted or (k and r >= k) for f, r in zip(files, replicas, strict=True))
        wd = self.withdrawal
        entry: dict[str, Any] = {
            "path": ns.path_of(d),
            "step": step_number(d.name),
            "complete": complete,
            "withdrawn": wd.is_withdrawn(d),
            "lost_files": [ns.path_of(f) for f in files if wd.lost(f)],
            "temporary": self.rules.is_temporary(ns, d),
            "files": len(files),
            "bytes": sum(f.size for f in files),
            "open_files": sum(1 for f in files if f.state != CLOSED),
            "in_ram": bool(files) and all(f.has_data for f in files),
            "files_in_ram": sum(1 for f in files if f.has_data),
            "persisted": bool(files) and all(f.persisted for f in files),
            "files_persisted": sum(1 for f in files if f.persisted),
            "replicas_min": min(replicas, default=0),
            "replicas_max": max(replicas, default=0),
            "safe": safe,
            "kept": d.ino in kept if self.retention.keep else None,
            "mtime": d.mtime_ns / 1e9,
        }
        if with_files:
            entry["file_list"] = [{
                "path": ns.path_of(f),
                "size": f.size,
                "state": f.state,
                "replicas": r,
                "holders": list(f.holders),
                "persisted": f.persisted,
                "in_ram": f.has_data,
            } for f, r in zip(files, replicas, strict=True)]
        return entry

    def of(self, d: Inode) -> dict[str, Any] | None:
        """A step directory's entry without its file list (user.mtcfs.state); None for
        a directory that is not a step."""
        if not is_step(self.ns, self.rules, d):
            return None
        return self.entry(d, self._kept(), with_files=False)

    def steps(self) -> dict[str, Any]:
        """Every step, oldest first, and the newest complete one that is safe."""
        kept = self._kept()
        steps = sorted((self.entry(d, kept) for d in all_steps(self.ns, self.rules)),
                       key=_order)
        safe = [e for e in steps if e["safe"]]
        return {"steps": steps,
                "newest_complete_safe": max(safe, key=_order)["path"] if safe else None,
                "replicas": self.copies.replicas,
                "keep_steps": self.retention.keep,
                "durable": self.durable_url}

    def newest_safe(self) -> dict[str, Any] | None:
        """The newest complete step that is safe: {"path", "step"}, or None."""
        for d in sorted(all_steps(self.ns, self.rules), reverse=True,
                        key=lambda d: (_number(d), d.mtime_ns / 1e9)):
            e = self.entry(d, set(), with_files=False)
            if e["safe"]:
                return {"path": e["path"], "step": e["step"]}
        return None


def _number(d: Inode) -> int:
    n = step_number(d.name)
    return n if n is not None else -1


def _order(e: dict[str, Any]) -> tuple[int, float]:
    return (e["step"] if e["step"] is not None else -1, e["mtime"])
