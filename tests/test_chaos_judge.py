"""The chaos harness's verdict on one committed step (support.chaos.judge_step), on
read-back records shaped as tests/support/chaos_io.py prints them: a withdrawn
step's intact files count where mtcfs put them, only what mtcfs did not say it
lost counts as lost, and a corrupt file is corrupt wherever it is."""

from __future__ import annotations

from typing import Any

from support.chaos import judge_step
from support.chaos_io import MARKER, WITHDRAWN

NAMES = ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp", MARKER]
HOSTS = ("h0", "h1", "h2")


def _withdrawn_step(missing_on: dict[str, set[str]]) -> dict[str, Any]:
    """Step 5 withdrawn on every host: its directory and marker renamed aside, each
    file read back intact under the withdrawn directory unless listed as missing."""
    hidden = "step_5" + WITHDRAWN
    dirs = {"step_5": {"errno": 2, "errname": "ENOENT"},
            hidden: sorted(["__0_0.distcp", "__2_0.distcp", MARKER + WITHDRAWN])}
    hosts = {}
    for h in HOSTS:
        files = {}
        for name in NAMES:
            if name in missing_on.get(h, set()):
                files[name] = {"result": "missing", "at": None}
            else:
                at = f"{hidden}/{name + WITHDRAWN if name == MARKER else name}"
                files[name] = {"result": "ok", "at": at}
        hosts[h] = files
    return {"dirs": {h: dirs for h in HOSTS}, "hosts": hosts, "bucket": {}}


def test_a_withdrawn_steps_intact_files_count_under_their_withdrawn_names() -> None:
    info = _withdrawn_step({h: {"__1_0.distcp"} for h in HOSTS})
    views = {h: ["step_5" + WITHDRAWN + "/__1_0.distcp"] for h in HOSTS}
    v = judge_step(5, info, 3, NAMES, views)
    assert v.mode == "withdrawn" and not v.bad
    assert v.lost == {} and v.corrupt == {} and v.lost_names == ["__1_0.distcp"]


def test_a_file_of_a_withdrawn_step_that_mtcfs_did_not_say_it_lost_is_lost() -> None:
    info = _withdrawn_step({"h0": {"__1_0.distcp"}, "h1": {"__1_0.distcp", "__2_0.distcp"},
                            "h2": {"__1_0.distcp"}})
    views = {h: ["step_5" + WITHDRAWN + "/__1_0.distcp"] for h in HOSTS}
    v = judge_step(5, info, 3, NAMES, views)
    assert v.mode == "withdrawn" and v.bad
    assert list(v.lost) == ["step_5/__2_0.distcp"] and v.lost["step_5/__2_0.distcp"] == [
        "h1: missing"]


def test_a_corrupt_file_of_a_withdrawn_step_is_corrupt() -> None:
    info = _withdrawn_step({h: {"__1_0.distcp"} for h in HOSTS})
    info["hosts"]["h2"]["__0_0.distcp"] = {"result": "corrupt", "at": "x", "got": "crc 1"}
    views = {h: ["step_5" + WITHDRAWN + "/__1_0.distcp"] for h in HOSTS}
    v = judge_step(5, info, 3, NAMES, views)
    assert v.bad and list(v.corrupt) == ["step_5/__0_0.distcp"] and v.lost == {}


def test_a_committed_steps_file_found_only_under_a_withdrawn_name_is_lost() -> None:
    dirs = {"step_7": sorted(NAMES)}
    ok = {name: {"result": "ok", "at": f"step_7/{name}"} for name in NAMES}
    hosts = {h: dict(ok) for h in HOSTS}
    hosts["h1"]["__2_0.distcp"] = {"result": "ok",
                                   "at": "step_7" + WITHDRAWN + "/__2_0.distcp"}
    info = {"dirs": {h: dirs for h in HOSTS}, "hosts": hosts, "bucket": dict(ok)}
    v = judge_step(7, info, 3, NAMES, {})
    assert v.mode == "committed" and v.bad
    assert v.lost == {"step_7/__2_0.distcp": [
        "h1: ok (found at step_7.mtcfs-withdrawn/__2_0.distcp)"]}
    hosts["h1"]["__2_0.distcp"] = ok["__2_0.distcp"]
    assert not judge_step(7, info, 3, NAMES, {}).bad


def test_a_step_committed_on_some_hosts_only_is_inconsistent() -> None:
    ok = {name: {"result": "ok", "at": f"step_9/{name}"} for name in NAMES}
    dirs = {h: {"step_9": sorted(NAMES)} for h in HOSTS}
    dirs["h2"] = {"step_9": sorted(set(NAMES) - {MARKER})}  # the marker never arrived
    hosts = {h: dict(ok) for h in HOSTS}
    hosts["h2"][MARKER] = {"result": "missing", "at": None}
    v = judge_step(9, {"dirs": dirs, "hosts": hosts, "bucket": dict(ok)}, 3, NAMES, {})
    assert v.mode == "inconsistent" and v.bad
    assert [k for k, _ in v.findings] == ["step_inconsistent"]
    assert v.lost == {"step_9/.metadata": ["h2: missing"]}


def test_a_write_is_unsent_only_if_its_host_was_cut_then_replaced_soon_after() -> None:
    """The K=1 window across a cut: written (or committed) while the writer's link was
    down, and the host replaced before its queued changes could have left it once the
    link came back (seed 46: h1 committed step 34 while cut off, 0.8 s before it was
    replaced; no other host ever knew the step was committed)."""
    from support.chaos import UNSENT_GRACE, unsent
    window = (100.0, 101.0)
    assert unsent(window, [[99.0, 102.0]], [102.8])
    assert unsent(window, [[100.5, None]], [150.0])  # still cut when replaced
    assert not unsent(window, [[99.0, 102.0]], [102.0 + UNSENT_GRACE + 1])  # had time
    assert not unsent(window, [[90.0, 99.0]], [99.5])  # cut before the write
    assert not unsent(window, [[99.0, 102.0]], [])  # never replaced: its RAM came back
    assert not unsent(window, [[99.0, 102.0]], [95.0])  # replaced before it wrote
    assert not unsent(None, [[99.0, 102.0]], [102.8])
