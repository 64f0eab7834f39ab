"""The in-process layer (tests/nofuse) needs no FUSE: run it where /dev/fuse is
not a device (a private mount namespace with an empty file bound over it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for unshare --mount")
def test_the_layer_runs_without_dev_fuse(tmp_path: Path) -> None:
    empty = tmp_path / "not-a-device"
    empty.touch()
    script = (f"{{ ! test -e /dev/fuse || mount --bind {empty} /dev/fuse; }} && "
              "! test -c /dev/fuse && "
              f"exec {sys.executable} -m pytest -q -p no:cacheprovider -m nofuse "
              f"--basetemp {tmp_path / 'base'} tests/nofuse")
    r = subprocess.run(["unshare", "--mount", "sh", "-c", script], cwd=ROOT,
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "failed" not in r.stdout and "error" not in r.stdout
