"""The replicated index's merge rules, on real indexes (each with its SQLite metadata
store) and no network: entries applied in the orders hosts see them."""

from __future__ import annotations

from pathlib import Path

import pytest

from mtcfs.peer.v1 import peer_pb2 as pb

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


def _renamed(e: pb.Entry, name: str, lamport: int, writer: str) -> pb.Entry:
    out = pb.Entry()
    out.CopyFrom(e)
    out.name, out.lamport, out.writer = name.encode(), lamport, writer
    return out


def test_a_directory_renamed_before_its_other_id_arrived_is_one_directory(
        tmp_path: Path) -> None:
    """Withdrawal renames a step made by every host (`step_9` -> `step_9.mtcfs-
    withdrawn`) on the host that merged the ids; a host that never saw the acting
    host's id under the old name (it was cut off, or restarted and lost its aliases)
    gets the renamed directory as a new one. It must fold its own `step_9/` into it:
    two chaos runs ended with the step split under both names, its lost files in one
    and its marker in the other, so the withdrawal could never be explained or undone."""
    h0 = simnet.IndexStore("h0", str(tmp_path / "h0"))
    h2 = simnet.IndexStore("h2", str(tmp_path / "h2"))
    d0 = simnet.entry("d0", "root", "step_9", 10, "h0", is_dir=True)
    d2 = simnet.entry("d2", "root", "step_9", 11, "h2", is_dir=True)
    shard0 = simnet.entry("f0", "d0", "__0_0.distcp", 12, "h0", size=5)
    shard2 = simnet.entry("f2", "d2", "__2_0.distcp", 13, "h2", size=5)
    h0.index.apply([d0, shard0, d2, shard2])  # merged on h0: d2 names d0
    h2.index.apply([d2, shard2])  # h2 cut off: it knows only its own
    # h0 renames the step; its entry now says which ids the directory goes by.
    ns0 = h0.index.ns
    step = ns0.by_global_id("d0")
    ns0.rename(ns0.inodes[step.parent], b"step_9", ns0.inodes[step.parent],
               b"step_9.mtcfs-withdrawn")
    h0.index.changed(step)
    renamed = h0.index.entry_of(step)
    assert list(renamed.merged_ids) == ["d2"]

    assert h2.index.apply([renamed, shard0]) >= 1
    assert _tree(h2) == {"step_9.mtcfs-withdrawn", "step_9.mtcfs-withdrawn/__0_0.distcp",
                         "step_9.mtcfs-withdrawn/__2_0.distcp"}
    # Later changes by either id land in the one directory.
    marker = simnet.entry("f9", "d2", ".metadata", 20, "h2", size=3)
    h2.index.apply([marker])
    h0.index.apply([marker])
    for s in (h0, h2):
        assert "step_9.mtcfs-withdrawn/.metadata" in _tree(s)
    # And a snapshot of h2 teaches a third host both ids in one directory.
    h1 = simnet.IndexStore("h1", str(tmp_path / "h1"))
    h1.index.apply(h2.snapshot())
    h1.index.apply([simnet.entry("f8", "d0", "__0_1.distcp", 21, "h0", size=5)])
    assert "step_9.mtcfs-withdrawn/__0_1.distcp" in _tree(h1) and not h1.index.pending
    for s in (h0, h1, h2):
        s.close()


def test_an_old_entry_still_teaches_that_two_ids_are_one_directory(tmp_path: Path) -> None:
    """Ids that name one directory never go stale: an entry older than this host's
    state of the directory still folds a directory this host keeps apart."""
    h2 = simnet.IndexStore("h2", str(tmp_path / "h2"))
    h2.index.apply([simnet.entry("d2", "root", "step_4", 11, "h2", is_dir=True),
                    simnet.entry("f2", "d2", "a", 12, "h2", size=5)])
    h2.index.apply([_renamed(simnet.entry("d0", "root", "x", 10, "h0", is_dir=True),
                             "step_4.w", 30, "h0"),
                    simnet.entry("f0", "d0", "b", 31, "h0", size=5)])
    assert _tree(h2) == {"step_4", "step_4/a", "step_4.w", "step_4.w/b"}
    old = simnet.entry("d0", "root", "x", 10, "h0", is_dir=True)  # older than h2's d0
    old.merged_ids.append("d2")
    assert h2.index.apply([old]) == 1
    assert _tree(h2) == {"step_4.w", "step_4.w/a", "step_4.w/b"}
    h2.close()


def test_a_directory_renamed_onto_another_merges_with_it(tmp_path: Path) -> None:
    """Concurrent changes put two directories at one name (a rename here, a mkdir
    there): every host ends with one directory holding both's entries, as when two
    hosts mkdir the same path; a name in both keeps the later change."""
    h = simnet.IndexStore("h1", str(tmp_path / "h1"))
    h.index.apply([simnet.entry("a", "root", "tmp", 10, "h0", is_dir=True),
                   simnet.entry("fa", "a", "x", 11, "h0", size=5),
                   simnet.entry("same_a", "a", "same", 12, "h0", size=5),
                   simnet.entry("b", "root", "latest", 13, "h1", is_dir=True),
                   simnet.entry("fb", "b", "y", 14, "h1", size=5),
                   simnet.entry("same_b", "b", "same", 15, "h1", size=5)])
    moved = _renamed(simnet.entry("a", "root", "tmp", 10, "h0", is_dir=True), "latest", 20, "h0")
    assert h.index.apply([moved]) == 1
    assert _tree(h) == {"latest", "latest/x", "latest/y", "latest/same"}
    ns = h.index.ns
    assert ns.child(ns.by_global_id("a"), b"same").guid == "same_b"
    # The id that lost its node names the merged directory.
    h.index.apply([simnet.entry("fz", "b", "z", 21, "h1", size=5)])
    assert "latest/z" in _tree(h)
    h.close()


def test_merged_ids_of_a_file_or_the_root_are_refused() -> None:
    from mtcfs.peer.security import BadRequest, check_entry
    f = simnet.entry("f1", "root", "a", 1, "h0", size=1)
    f.merged_ids.append("d1")
    with pytest.raises(BadRequest):
        check_entry(f)
    d = simnet.entry("d1", "p", "a", 1, "h0", is_dir=True)
    for bad in ("root", "p", "x/y"):
        d.ClearField("merged_ids")
        d.merged_ids.append(bad)
        with pytest.raises(BadRequest):
            check_entry(d)
    d.ClearField("merged_ids")
    d.merged_ids.append("d7")
    check_entry(d)


def test_a_merged_directory_newer_elsewhere_is_stored_as_it_is_in_memory(
        tmp_path: Path) -> None:
    """The fuzzer's finding: a directory merged with a newer one took its attributes in
    memory only; a restart loaded the older ones."""
    h = simnet.IndexStore("h1", str(tmp_path / "h1"))
    h.index.apply([simnet.entry("d1", "root", "step_3", 10, "h1", is_dir=True)])
    newer = simnet.entry("d0", "root", "step_3", 20, "h0", is_dir=True)
    newer.mode = 0o40700
    h.index.apply([newer])
    h.close()
    again = simnet.IndexStore("h1", str(tmp_path / "h1"))
    d = again.index.ns.by_global_id("d1")
    assert (d.lamport, d.writer, d.mode & 0o777) == (20, "h0", 0o700)
    again.close()
