"""The status module's health rules (mtcfs/status.py): "degraded" while uploads fail
now, while writers wait for (or were just refused by) a full RAM tier, and while
commits returned before every peer had them; "ok" otherwise."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from mtcfs.status import DEGRADED, OK, health, mount_status

from support.inprocess import Host, until

pytestmark = [pytest.mark.nofuse, pytest.mark.trio]


def status(durable: dict[str, Any] | None = None, writers_waiting: int = 0,
           last_full_age: float | None = None, timeouts: int = 0) -> dict[str, Any]:
    return {"durable": durable,
            "lifecycle": {"writers_waiting": writers_waiting, "last_full_age": last_full_age},
            "visibility": {"timeouts": timeouts}}


def failing(retrying_in: float = 0.0) -> dict[str, Any]:
    return {"last_error": "upload f: unavailable", "retrying_in": retrying_in}


async def test_healthy_by_default() -> None:
    assert health(status(), error_age=1e9, uploads_idle=True, broadcast_quiet=True) == OK
    assert health(status(durable={"last_error": None, "retrying_in": 0}), error_age=1e9,
                  uploads_idle=False, broadcast_quiet=True) == OK


async def test_uploads_failing_now_degrade() -> None:
    # Backing off with uploads pending.
    assert health(status(durable=failing(retrying_in=2.0)), error_age=100.0,
                  uploads_idle=False, broadcast_quiet=True) == DEGRADED
    # A tier call retrying through an outage: an error in the last 30 s.
    assert health(status(durable=failing()), error_age=5.0, uploads_idle=False,
                  broadcast_quiet=True) == DEGRADED
    # An old error, no backoff: recovered.
    assert health(status(durable=failing()), error_age=31.0, uploads_idle=False,
                  broadcast_quiet=True) == OK
    # Nothing left to upload: an error does not matter any more.
    assert health(status(durable=failing(retrying_in=2.0)), error_age=1.0, uploads_idle=True,
                  broadcast_quiet=True) == OK


async def test_a_full_ram_tier_degrades() -> None:
    assert health(status(writers_waiting=1), 1e9, True, True) == DEGRADED
    assert health(status(last_full_age=10.0), 1e9, True, True) == DEGRADED
    assert health(status(last_full_age=61.0), 1e9, True, True) == OK


async def test_commit_timeouts_degrade_until_the_broadcast_is_quiet() -> None:
    assert health(status(timeouts=1), 1e9, True, broadcast_quiet=False) == DEGRADED
    assert health(status(timeouts=1), 1e9, True, broadcast_quiet=True) == OK


async def test_a_mount_degrades_while_its_uploads_fail(make_host, tmp_path: Path,
                                                      monkeypatch) -> None:
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    h: Host = await make_host(bucket=f"file://{bucket}", persist="on-close")
    up = h.mount.uploader
    real_put = up.tier.put_file
    outage = True

    def put_file(*args: Any, **kwargs: Any) -> Any:
        if outage:
            raise OSError("the bucket is unreachable")
        return real_put(*args, **kwargs)

    monkeypatch.setattr(up.tier, "put_file", put_file)
    st = mount_status(h.mount, "http://127.0.0.1:1/metrics")
    assert st["health"] == "ok" and st["metrics_url"] == "http://127.0.0.1:1/metrics"
    assert st["durable"]["url"] == f"file://{bucket}"
    assert "listed_objects" in st["durable"]["readthrough"]
    await h.write_file("f", b"data")
    await until(lambda: up.stats.errors >= 1, what="a failed upload")
    st = mount_status(h.mount)
    assert st["health"] == "degraded", st["durable"]
    assert "the bucket is unreachable" in st["durable"]["last_error"]
    outage = False
    await until(lambda: h.node("f").persisted, what="f persisted after the outage")
    up.stats.last_error_time = time.time() - 60  # the error is old news now
    assert mount_status(h.mount)["health"] == "ok"
