"""The replicated index's merge rules, on real indexes (each with its SQLite metadata
store) and no network: entries applied in the orders hosts see them."""

from __future__ import annotations

from pathlib import Path

import pytest

from support import simnet

pytestmark = pytest.mark.nofuse


def _tree(store: simnet.IndexStore) -> set[str]:
    ns = store.index.ns
    return {ns.path_of(n) for n in ns.inodes.values() if n.linked and n.guid != "root"}


def test_a_host_that_joins_by_snapshot_learns_the_ids_a_merged_directory_goes_by(
        tmp_path: Path) -> None:
    """Two hosts make the same step directory (every DCP rank mkdirs it), each under
    its own id; the third host, restarted meanwhile, learns the directory from one
    host's snapshot. The other host's later files name the directory by its own id:
    they must land in it, not wait for a parent that will never come (a chaos run
    lost a commit marker this way: the step never committed there)."""
    h0 = simnet.IndexStore("h0", str(tmp_path / "h0"))
    h1 = simnet.IndexStore("h1", str(tmp_path / "h1"))
    mine, theirs = (simnet.entry("d0", "root", "step_31", 10, "h0", is_dir=True),
                    simnet.entry("d1", "root", "step_31", 11, "h1", is_dir=True))
    h0.index.apply([mine])
    h0.index.apply([theirs])  # merged: d1 is an alias of d0 on h0
    h1.index.apply([theirs])
    h1.index.apply([mine])  # and d0 one of d1 on h1
    shard = simnet.entry("f1", "d1", "__1_0.distcp", 12, "h1", size=5)
    h0.index.apply([shard])

    h2 = simnet.IndexStore("h2", str(tmp_path / "h2"))
    h2.index.apply(h0.snapshot())
    assert "step_31/__1_0.distcp" in _tree(h2)
    marker = simnet.entry("f2", "d1", ".metadata", 13, "h1", size=3)  # h1's commit
    assert h2.index.apply([marker]) == 1
    assert "step_31/.metadata" in _tree(h2) and not h2.index.pending
    # A snapshot says each id once per directory: re-applied, it changes nothing.
    assert h2.index.apply(h0.snapshot()) == 0
    for s in (h0, h1, h2):
        s.close()


def test_a_delta_snapshot_carries_the_ids_of_a_directory_merged_in_it(tmp_path: Path) -> None:
    """A host back from a short absence catches up by delta: a directory merged while
    it was away comes with its other ids too."""
    t = [100.0]
    h0 = simnet.IndexStore("h0", str(tmp_path / "h0"), now=lambda: t[0])
    h0.index.apply([simnet.entry("d0", "root", "step_2", 10, "h0", is_dir=True)])
    h2 = simnet.IndexStore("h2", str(tmp_path / "h2"))
    h2.index.apply(h0.snapshot())
    t[0] = 200.0
    h0.index.apply([simnet.entry("d1", "root", "step_2", 11, "h1", is_dir=True)])
    pieces = h0.index.delta_pieces(50.0, 100)
    assert pieces is not None
    for piece in pieces:
        h2.index.apply(piece)
    h2.index.apply([simnet.entry("f1", "d1", "__1_0.distcp", 12, "h1", size=5)])
    assert "step_2/__1_0.distcp" in _tree(h2) and not h2.index.pending
    for s in (h0, h2):
        s.close()
