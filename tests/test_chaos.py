"""The chaos suite (tests/support/chaos.py): a short smoke in every `make test`, the real thing with
`make chaos` or `pytest -m chaos` (deselected by default, see pyproject.toml).

    make chaos CHAOS_MINUTES=30 CHAOS_SEED=1 CHAOS_FSYNC=replicas
    CHAOS_MINUTES=5 CHAOS_SEED=3 CHAOS_FSYNC=local pytest -m chaos tests/test_chaos.py -s

The smoke runs about 75 s of chaos with a fixed seed and small shards, with
`--fsync replicas` (no withdrawal is acceptable there), and checks the same
invariants as a full run: nothing corrupt, nothing lost, no marker in the bucket
for an incomplete step, no hang, no daemon crash. It injects kill -9 with a remount,
SIGSTOP of a daemon and of the GCS server, and GCS restarts, but no network cuts and no
host replacements yet: those break steps today (tests/test_chaos_findings.py); give
them their default weights back when those tests pass.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from support.chaos import DEFAULT_WEIGHTS, Config, report, run
from support.netns import netns_unavailable

pytestmark = pytest.mark.skipif(netns_unavailable() is not None,
                                reason=netns_unavailable() or "")

SMOKE_SECONDS = float(os.environ.get("MTCFS_CHAOS_SMOKE_SECONDS", "75"))


def check(r: dict) -> None:
    assert r["ok"], report(r)
    assert r["steps_committed"] > 0


@pytest.mark.slow
def test_chaos_smoke(tmp_path: Path) -> None:
    weights = {**DEFAULT_WEIGHTS, "netcut": 0, "kill_replace": 0}  # see the module doc
    cfg = Config(seconds=SMOKE_SECONDS, seed=7, fsync="replicas", shard_kib=512,
                 step_interval=0.5, fault_every=6.0, weights=weights, settle_timeout=120,
                 quiet=True)
    r = run(cfg, tmp_path / "chaos")
    check(r)
    assert sum(r["faults"].values()) >= 5, r["faults"]


@pytest.mark.chaos
def test_chaos(tmp_path: Path) -> None:
    """CHAOS_MINUTES (5), CHAOS_SEED (1), CHAOS_FSYNC (local|replicas)."""
    cfg = Config(seconds=float(os.environ.get("CHAOS_MINUTES", "5")) * 60,
                 seed=int(os.environ.get("CHAOS_SEED", "1")),
                 fsync=os.environ.get("CHAOS_FSYNC", "local"))
    check(run(cfg, tmp_path / "chaos"))
