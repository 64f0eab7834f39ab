"""Word from outside SWIM that a host is gone (mtcfs controller: Kubernetes deleted its
pod): a probe at once, dead without the suspicion period if no ack comes by its
deadline, and never dead on the word alone."""

from __future__ import annotations

import random

import pytest

from mtcfs.peer import swim

pytestmark = pytest.mark.nofuse

CFG = swim.SwimConfig()


def _host() -> tuple[swim.Swim, swim.Recorder]:
    rec = swim.Recorder()
    return swim.Swim("a", ["b", "c", "d"], rec, random.Random(1), CFG), rec


def _run(s: swim.Swim, start: float, until: float) -> list[tuple[str, swim.Message]]:
    out, t = [], start
    while t <= until:
        out += s.tick(t)
        t += swim.TICK
    return out


def test_a_host_said_gone_that_does_not_answer_is_dead_within_one_probe() -> None:
    s, rec = _host()
    out = s.gone("b", 10.0)
    assert [(dst, m.kind) for dst, m in out] == [("b", swim.PING)]
    _run(s, 10.0, 10.0 + CFG.probe_deadline() + swim.TICK)
    assert s.state_of("b") == swim.DEAD and [n for n, _ in rec.dead] == ["b"]
    # Far sooner than probes alone: suspected first, dead after the suspicion period.
    assert CFG.probe_deadline() < CFG.probe_deadline() + CFG.suspicion_timeout(4)
    assert s.counters.suspicions == 0


def test_a_host_said_gone_that_answers_stays_alive() -> None:
    s, rec = _host()
    (dst, ping), = s.gone("c", 10.0)
    s.on_message("c", swim.Message(swim.ACK, seq=ping.seq, target="c"), 10.01)
    _run(s, 10.0, 10.0 + 3 * CFG.probe_deadline())
    assert s.state_of("c") == swim.ALIVE and rec.dead == []


def test_an_ack_through_another_host_keeps_it_alive() -> None:
    """The indirect pings of the evidence probe count: a host cut off from this one
    only is not declared dead on the word."""
    s, rec = _host()
    (_, ping), = s.gone("d", 10.0)
    end = 10.0 + CFG.probe_deadline() - swim.TICK
    out = _run(s, 10.0, end)
    assert any(m.kind == swim.PING_REQ and m.target == "d" for _, m in out)
    s.on_message("b", swim.Message(swim.ACK, seq=ping.seq, target="d"), end)
    _run(s, end + swim.TICK, 10.0 + 3 * CFG.probe_deadline())
    assert s.state_of("d") == swim.ALIVE and rec.dead == []


def test_word_of_a_host_already_probed_joins_that_probe() -> None:
    s, rec = _host()
    s.probe("b", 10.0)  # a call to it failed
    assert s.gone("b", 10.05) == []  # no second ping: the running probe now counts
    _run(s, 10.0, 10.0 + CFG.probe_deadline() + swim.TICK)
    assert s.state_of("b") == swim.DEAD and s.counters.suspicions == 0


def test_word_of_an_unknown_or_dead_host_changes_nothing() -> None:
    s, rec = _host()
    assert s.gone("zz", 1.0) == []
    s.gone("b", 1.0)
    _run(s, 1.0, 1.0 + CFG.probe_deadline() + swim.TICK)
    assert s.gone("b", 5.0) == [] and [n for n, _ in rec.dead] == ["b"]
