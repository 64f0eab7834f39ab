"""The house's rules, read from the source: every import in mtcfs/ and bench/ (also
those only for type checking, and those inside functions) points down the layers
below, and no module imports itself round a circle. A new package goes into
LAYERS where it belongs (docs/architecture.md says where code goes)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Lowest first. A module may import from its own layer's packages or lower ones.
LAYERS: list[list[str]] = [
    ["mtcfs", "mtcfs.sizes", "mtcfs.mountinfo", "mtcfs.probes", "mtcfs.core", "mtcfs.peer.v1"],
    ["mtcfs.tiers"],
    ["mtcfs.fetch"],
    ["mtcfs.fs"],
    ["mtcfs.peer"],
    ["mtcfs.lifecycle", "mtcfs.persist"],
    ["mtcfs.config"],
    ["mtcfs.absent", "mtcfs.assembly"],
    ["mtcfs.control", "mtcfs.metrics", "mtcfs.status"],
    ["mtcfs.daemon"],
    ["mtcfs.csi", "mtcfs.k8s"],
    ["mtcfs.cli", "mtcfs.__main__"],
    ["bench"],
]


def _modules() -> dict[str, Path]:
    out = {}
    for f in [*ROOT.glob("mtcfs/**/*.py"), *ROOT.glob("bench/*.py")]:
        if f.name.endswith("_pb2.py") or f.name.endswith("_pb2_grpc.py"):
            continue
        parts = list(f.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = f
    return out


def _imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    def known(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        out: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[:len(pkg.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            for name in names:
                # `from mtcfs.x import y`: y is a module if there is one, else a name in x.
                target = known(name)
                if target is not None and target != mod:
                    out.add(target)
        graph[mod] = out
    return graph


def _layer(mod: str) -> int:
    best, found = -1, -1
    for i, layer in enumerate(LAYERS):
        for prefix in layer:
            if (mod == prefix or mod.startswith(prefix + ".")) and len(prefix) > best:
                best, found = len(prefix), i
    assert found >= 0, f"{mod}: in no layer (add its package to LAYERS)"
    return found


def test_every_import_points_down_the_layers() -> None:
    graph = _imports(_modules())
    up = sorted(f"{m} -> {t}" for m, ts in graph.items() for t in ts if _layer(t) > _layer(m))
    assert up == [], "imports running up the layers:\n" + "\n".join(up)


def test_no_module_imports_itself_round_a_circle() -> None:
    graph = _imports(_modules())
    state: dict[str, int] = {}  # 1: on the path, 2: done
    circles: list[str] = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                circles.append(" -> ".join(path[path.index(t):] + [t]))
            elif t not in state:
                visit(t, path + [t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert circles == [], "import circles:\n" + "\n".join(circles)
