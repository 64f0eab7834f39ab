"""The write clock sees passthrough writes it does not serve, from the RAM files of
the files open for writing (replication yields to a save in progress)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from mtcfs.fs.writeclock import WriteClock


def test_a_passthrough_writer_counts_as_writing_while_its_ram_file_changes(tmp_path: Path):
    files = {7: tmp_path / "7"}
    files[7].write_bytes(b"")
    clock = WriteClock(lambda ino: os.stat(files[ino]))
    assert clock.last_write() == 0.0
    clock.passthrough_opened(7)
    opened = clock.last_write()  # the open counts as a write (and the first look)
    assert opened > 0
    time.sleep(0.01)
    assert clock.last_write() == opened  # open, but not written since: not a save
    with open(files[7], "ab") as f:
        f.write(b"x" * 4096)  # the kernel writes to the RAM file (passthrough)
    written = clock.last_write()
    assert written > opened
    time.sleep(0.01)
    assert clock.last_write() == written
    clock.passthrough_released(7, writers_left=0)
    with open(files[7], "ab") as f:
        f.write(b"y")
    assert clock.last_write() == written  # no longer watched


def test_a_file_still_open_by_another_writer_stays_watched(tmp_path: Path):
    p = tmp_path / "3"
    p.write_bytes(b"")
    clock = WriteClock(lambda ino: os.stat(p))
    clock.passthrough_opened(3)
    clock.passthrough_opened(3)
    clock.last_write()
    clock.passthrough_released(3, writers_left=1)
    before = clock.last_write()
    time.sleep(0.01)
    p.write_bytes(b"more")
    assert clock.last_write() > before
