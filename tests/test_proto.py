"""The checked-in peer protocol code is what `make proto` generates from proto/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO = "mtcfs/peer/v1/peer.proto"
GENERATED = ("peer_pb2.py", "peer_pb2.pyi", "peer_pb2_grpc.py")


def test_generated_code_is_current(tmp_path):
    # The same command as the Makefile's `proto` target, into a temporary directory.
    r = subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-Iproto", f"--python_out={tmp_path}",
         f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", f"proto/{PROTO}"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 0, f"protoc failed:\n{r.stderr}"
    out_dir = tmp_path / "mtcfs/peer/v1"
    made = sorted(p.name for p in out_dir.iterdir())
    assert made == sorted(GENERATED), made
    checked_in = ROOT / "mtcfs/peer/v1"
    stale = [name for name in GENERATED
             if not (checked_in / name).exists()
             or (checked_in / name).read_bytes() != (out_dir / name).read_bytes()]
    assert not stale, (f"{', '.join(stale)} in mtcfs/peer/v1 differ from what {PROTO} "
                       f"generates: run `make proto` and commit the result")
