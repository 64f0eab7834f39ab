"""The checked-in protocol code (peer protocol, CSI subset) is what `make proto`
generates from proto/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# (protoc -I argument, .proto file, package directory of the generated code, its files);
# the same commands as the Makefile's `proto` target.
PROTOS = [
    ("proto", "proto/mtcfs/peer/v1/peer.proto", "mtcfs/peer/v1",
     ("peer_pb2.py", "peer_pb2.pyi", "peer_pb2_grpc.py")),
    ("mtcfs/csi/v1=proto/csi/v1", "proto/csi/v1/csi.proto", "mtcfs/csi/v1",
     ("csi_pb2.py", "csi_pb2.pyi", "csi_pb2_grpc.py")),
]


@pytest.mark.parametrize(("include", "proto", "package", "generated"), PROTOS,
                         ids=[p[2] for p in PROTOS])
def test_generated_code_is_current(tmp_path, include, proto, package, generated):
    # Generated into a temporary directory, then compared byte for byte.
    r = subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{include}", f"--python_out={tmp_path}",
         f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", proto],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 0, f"protoc failed:\n{r.stderr}"
    out_dir = tmp_path / package
    made = sorted(p.name for p in out_dir.iterdir())
    assert made == sorted(generated), made
    checked_in = ROOT / package
    stale = [name for name in generated
             if not (checked_in / name).exists()
             or (checked_in / name).read_bytes() != (out_dir / name).read_bytes()]
    assert not stale, (f"{', '.join(stale)} in {package} differ from what {proto} "
                       f"generates: run `make proto` and commit the result")
