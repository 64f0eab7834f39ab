"""Steps: which directories hold a committed checkpoint (docs/semantics.md).

A step is committed when a commit marker is present under its final name in a
directory that has its final name: no component of its path matches a
temporary-name pattern.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

from mtcfs.core.namespace import ROOT, Inode, Namespace

DEFAULT_MARKERS = (".metadata", "_CHECKPOINT_METADATA", "commit_success.txt")
DEFAULT_TMP_PATTERNS = ("*.orbax-checkpoint-tmp*", "*.tmp")
_NUMBER = re.compile(r"\d+")
_STEP_WORD = re.compile(r"(?:step|ckpt|checkpoint|iter|iteration|epoch)[_-]?(\d+)", re.I)


@dataclass(frozen=True)
class StepRules:
    markers: tuple[str, ...] = DEFAULT_MARKERS
    tmp_patterns: tuple[str, ...] = DEFAULT_TMP_PATTERNS
    _marker_set: frozenset[bytes] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_marker_set", frozenset(m.encode() for m in self.markers))

    def is_marker_name(self, name: bytes) -> bool:
        return name in self._marker_set

    def is_temporary_name(self, name: bytes) -> bool:
        text = name.decode("utf-8", "surrogateescape")
        return any(fnmatch.fnmatchcase(text, p) for p in self.tmp_patterns)

    def is_temporary(self, ns: Namespace, node: Inode) -> bool:
        """True if the node or any directory above it has a temporary name."""
        while node.ino != ROOT:
            if self.is_temporary_name(node.name):
                return True
            node = ns.inodes[node.parent]
        return False

    def is_committed_step(self, ns: Namespace, d: Inode) -> bool:
        if not d.is_dir or not d.linked or d.ino == ROOT or not d.children:
            return False
        if not any(m in d.children for m in self._marker_set):
            return False
        return not self.is_temporary(ns, d)

    def enclosing_step(self, ns: Namespace, node: Inode) -> Inode | None:
        """The nearest committed step directory at or above `node`'s parent."""
        d = ns.inodes[node.parent] if node.ino != ROOT else node
        while True:
            if self.is_committed_step(ns, d):
                return d
            if d.ino == ROOT:
                return None
            d = ns.inodes[d.parent]


def step_number(name: bytes) -> int | None:
    """`step_100`, `checkpoint-100`, `llama3-step-100`, `100`, `100.orbax-checkpoint-tmp-17`
    -> 100: the number after a step word, else the first number."""
    text = name.decode("utf-8", "surrogateescape")
    m = _STEP_WORD.search(text) or _NUMBER.search(text)
    return int(m.group(m.lastindex or 0)) if m else None


def files_under(ns: Namespace, d: Inode) -> Iterator[Inode]:
    """Every regular file below directory `d`, depth first."""
    stack = [d]
    while stack:
        cur = stack.pop()
        for ino in (cur.children or {}).values():
            node = ns.inodes[ino]
            if node.is_dir:
                stack.append(node)
            elif node.is_file:
                yield node


def all_steps(ns: Namespace, rules: StepRules) -> list[Inode]:
    """Directories that look like steps: committed, or named like one (a
    number in the name, or a temporary name) with files in them."""
    return [node for node in ns.inodes.values() if is_step(ns, rules, node)]


def is_step(ns: Namespace, rules: StepRules, node: Inode) -> bool:
    """A directory that all_steps lists."""
    if not node.is_dir or not node.linked or node.ino == ROOT:
        return False
    named_like_step = node.parent == ROOT and (
        step_number(node.name) is not None or rules.is_temporary_name(node.name))
    return named_like_step or rules.is_committed_step(ns, node)


def dirs_under(ns: Namespace, d: Inode) -> list[Inode]:
    """Every directory below directory `d`."""
    out, stack = [], [d]
    while stack:
        cur = stack.pop()
        for ino in (cur.children or {}).values():
            child = ns.inodes[ino]
            if child.is_dir:
                out.append(child)
                stack.append(child)
    return out


def newest_complete_step(ns: Namespace, rules: StepRules) -> Inode | None:
    """The committed step with the highest number (then the newest mtime)."""
    steps = [d for d in all_steps(ns, rules) if rules.is_committed_step(ns, d)]
    if not steps:
        return None
    return max(steps, key=lambda d: (step_number(d.name) or -1, d.mtime_ns))
