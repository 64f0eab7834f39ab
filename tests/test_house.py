"""The house's rules about owners, read from the source: a file's state, version and
checksums have one writer, mtcfs.core.versions.Versions (docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# What a file's content is: only Versions assigns these on an inode.
VERSION_FIELDS = {"state", "version", "crc32c", "block_crcs"}
OWNER = "mtcfs/core/versions.py"

# Assignments of those names to things that are not inodes, and the one inode
# assignment outside Versions that is allowed: (file, "object.field").
NOT_INODES = {
    ("mtcfs/core/namespace.py", "node.state"),  # new_inode: a new file starts open
    ("mtcfs/peer/restore.py", "self.state"),  # a restore's chunk states
    ("mtcfs/peer/swim.py", "m.state"),  # a member's liveness
    ("mtcfs/peer/index.py", "e.crc32c"),  # an index entry (pb.Entry) made from an inode
    ("mtcfs/peer/index.py", "e.block_crcs"),
    ("mtcfs/tiers/durable/gcs.py", "blob.crc32c"),  # an object's checksum on upload
    ("bench/durable.py", "self.version"),  # a tool's version
    ("fuzz/seeds.py", "v2.version"),  # an index entry
}


def _assigned(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, "object.field") of every assignment to a version field."""
    out: list[tuple[int, str]] = []

    def targets(t: ast.expr) -> list[ast.expr]:
        if isinstance(t, (ast.Tuple, ast.List)):
            return [x for e in t.elts for x in targets(e)]
        return [t]

    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            ts = [x for t in node.targets for x in targets(t)]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            ts = targets(node.target)
        else:
            continue
        for t in ts:
            if isinstance(t, ast.Attribute) and t.attr in VERSION_FIELDS:
                out.append((t.lineno, f"{ast.unparse(t.value)}.{t.attr}"))
    # setattr(node, "state", ...) would hide one from the rule: counted too.
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id == "setattr" and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and node.args[1].value in VERSION_FIELDS):
            out.append((node.lineno, f"{ast.unparse(node.args[0])}.{node.args[1].value}"))
    return out


def _sources() -> list[Path]:
    return sorted(p for d in ("mtcfs", "bench", "fuzz") for p in (ROOT / d).rglob("*.py")
                  if not p.name.endswith(("_pb2.py", "_pb2_grpc.py")))


def test_only_versions_writes_a_files_state_version_and_checksums() -> None:
    found = []
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        if rel == OWNER:
            continue
        for line, what in _assigned(ast.parse(path.read_text())):
            if (rel, what) not in NOT_INODES:
                found.append(f"{rel}:{line}: {what} = ...")
    assert found == [], ("a file's state, version and checksums change only through "
                         "mtcfs.core.versions.Versions:\n" + "\n".join(found))


def test_the_rule_sees_every_kind_of_assignment() -> None:
    src = ("node.state = 'closed'\n"
           "node.version += 1\n"
           "a.size, a.crc32c = 1, 2\n"
           "[b.block_crcs] = [None]\n"
           "setattr(c, 'version', 3)\n"
           "node.size = 4\n")
    assert [w for _, w in _assigned(ast.parse(src))] == [
        "node.state", "node.version", "a.crc32c", "b.block_crcs", "c.version"]


def test_versions_is_in_the_core() -> None:
    """Every layer may use it: it imports nothing but the core."""
    tree = ast.parse((ROOT / OWNER).read_text())
    modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    modules |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert all(m == "__future__" or m.startswith("mtcfs.core.") for m in modules), modules


MAX_CLASS_LINES = 500


def test_no_class_plays_so_many_roles_it_is_over_500_lines() -> None:
    """A class that grows past this is doing two jobs: split it by role."""
    big = []
    for path in [*ROOT.glob("mtcfs/**/*.py"), *ROOT.glob("bench/*.py")]:
        if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_CLASS_LINES:
                    big.append(f"{path.relative_to(ROOT)}: {node.name} ({lines} lines)")
    assert big == [], "classes over 500 lines:\n" + "\n".join(big)
