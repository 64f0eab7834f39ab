"""SWIM membership (mtcfs.peer.swim) on many hosts in virtual time over the
in-process network of support.simnet: suspicion is refuted, a partitioned
minority is declared dead and comes back, replica partners see a death
first, and no host's cost grows with the job."""

from __future__ import annotations

import random

import pytest

from mtcfs.peer import swim

from support import simnet


def everyone_sees_everyone(net: simnet.Net) -> bool:
    up = [h for h in net.hosts.values() if h.up]
    return all(all(h.swim.state_of(o.node) == swim.ALIVE for o in up if o is not h)
               for h in up)


def test_a_suspected_host_refutes_with_a_higher_incarnation() -> None:
    rec = swim.Recorder()
    a = swim.Swim("a", ["b", "c"], rec, random.Random(0))
    out = a.on_message("b", swim.Message(swim.GOSSIP, updates=(swim.Update("a", swim.SUSPECT,
                                                                            0),)), 1.0)
    assert out == [] and a.incarnation == 1
    # The refutation goes out on the next message, and others take it over the suspicion.
    dst, msg = a.tick(2.0)[0]
    assert swim.Update("a", swim.ALIVE, 1) in msg.updates
    b = swim.Swim("b", ["a", "c"], swim.Recorder(), random.Random(1))
    b.on_message("c", swim.Message(swim.GOSSIP, updates=(swim.Update("a", swim.SUSPECT, 0),)),
                 1.0)
    assert b.state_of("a") == swim.SUSPECT
    b.on_message(dst, msg, 2.0)
    assert b.state_of("a") == swim.ALIVE
    # Past the suspicion timeout nothing is declared dead: the suspicion was lifted.
    b.tick(100.0)
    assert b.state_of("a") != swim.DEAD


def test_a_restarted_member_is_reported_and_a_refutation_is_not() -> None:
    """A member's incarnation is its start time in ms: one that jumps by a second or
    more while it stays alive is a new process (what it held as a tree child is lost);
    a refutation (+1) is not, nor the first incarnation heard of a configured member."""
    rec = swim.Recorder()
    a = swim.Swim("a", ["b", "c"], rec, random.Random(0))
    start = 1_700_000_000_000
    a.on_message("b", swim.Message(swim.GOSSIP, updates=(swim.Update("b", swim.ALIVE,
                                                                    start),)), 1.0)
    a.on_message("c", swim.Message(swim.GOSSIP, updates=(swim.Update("b", swim.ALIVE,
                                                                    start + 1),)), 2.0)
    assert rec.restarted == [] and a.state_of("b") == swim.ALIVE
    a.on_message("b", swim.Message(swim.GOSSIP, updates=(
        swim.Update("b", swim.ALIVE, start + 1 + swim.RESTART_JUMP),)), 3.0)
    assert rec.restarted == [("b", 0.0)]
    assert not [n for n, _ in rec.dead if n == "b"]


def test_false_suspicions_under_message_loss_are_refuted() -> None:
    net = simnet.cluster(40, seed=3, loss=0.12)
    net.loop.run_until(30.0)
    hosts = list(net.hosts.values())
    suspicions = sum(h.swim.counters.suspicions for h in hosts)
    refutations = sum(h.swim.counters.refutations for h in hosts)
    assert suspicions > 0, "12% loss should cause some suspicions"
    assert refutations > 0
    net.loss = 0.0
    assert net.loop.run_until_true(lambda: everyone_sees_everyone(net), 10.0) is not None


def test_a_healed_partition_does_not_make_the_larger_side_flap() -> None:
    """Seen on real daemons (3 hosts, one cut off for a few seconds): the cut-off host's
    first message after the heal says the others are dead, fresh news. A host of the
    larger side refutes its own death, but must neither take the cut-off host's view
    (SYNC) nor keep spreading its own deaths news; it syncs from a host of its side."""
    rec = swim.Recorder()
    a = swim.Swim("a", ["b", "c"], rec, random.Random(0))
    for src in ("b", "c"):
        a.on_message(src, swim.Message(swim.GOSSIP, incarnation=5), 1.0)
    a.on_message("b", swim.Message(swim.GOSSIP, incarnation=5,
                                   updates=(swim.Update("c", swim.DEAD, 5),)), 2.0)
    assert a.state_of("c") == swim.DEAD
    # c speaks again, at the life a holds dead: "a and b are dead".
    out = a.on_message("c", swim.Message(swim.PING, seq=9, incarnation=5, updates=(
        swim.Update("a", swim.DEAD, 0), swim.Update("b", swim.DEAD, 5))), 3.0)
    assert a.incarnation == 1 and a.state_of("b") == swim.ALIVE
    assert [m.kind for dst, m in out] == [swim.ACK], out  # no SYNC to c
    assert a.counters.death_news_dropped >= 1
    # Its refutation goes out; its deaths news does not (only c itself is told).
    sent = [u for dst, m in a.tick(3.05) + a.tick(3.3) if dst != "c" for u in m.updates]
    assert swim.Update("a", swim.ALIVE, 1) in sent, sent
    assert not [u for u in sent if u.state == swim.DEAD], sent
    # b (of a's side) speaks: a syncs from it.
    out = a.on_message("b", swim.Message(swim.GOSSIP, incarnation=5), 3.1)
    assert [(dst, m.kind) for dst, m in out] == [("b", swim.SYNC)], out
    # Resyncing, a gives no view to the other side (c, held dead) until b's reply
    # came; to its own side it does (b may be resyncing too).
    [(dst, reply)] = a.on_message("b", swim.Message(swim.SYNC, incarnation=5), 3.15)
    assert dst == "b" and reply.kind == swim.SYNC_REPLY
    assert a.on_message("c", swim.Message(swim.SYNC, incarnation=5), 3.2) == []
    a.on_message("b", swim.Message(swim.SYNC_REPLY, incarnation=5, updates=(
        swim.Update("c", swim.DEAD, 5),)), 3.3)
    [(dst, reply)] = a.on_message("c", swim.Message(swim.SYNC, incarnation=5), 3.4)
    assert dst == "c" and reply.kind == swim.SYNC_REPLY
    # Alone on its side (everyone else dead), a host syncs from whoever speaks.
    z = swim.Swim("z", ["x", "y"], swim.Recorder(), random.Random(1))
    for src in ("x", "y"):
        z.on_message(src, swim.Message(swim.GOSSIP, incarnation=5), 1.0)
        z.on_message(src, swim.Message(swim.GOSSIP, incarnation=5,
                                       updates=(swim.Update(src, swim.DEAD, 5),)), 1.5)
    out = z.on_message("x", swim.Message(swim.PING, seq=3, incarnation=5,
                                         updates=(swim.Update("z", swim.DEAD, 0),)), 2.0)
    assert ("x", swim.SYNC) in [(dst, m.kind) for dst, m in out], out


@pytest.mark.parametrize(("hosts", "cut"), [(40, 5), (40, 18), (3, 1)])
def test_a_partitioned_minority_is_declared_dead_and_rejoins_when_healed(hosts: int,
                                                                         cut: int) -> None:
    net = simnet.cluster(hosts, seed=5)
    net.loop.run_until(3.0)
    ids = list(net.hosts)
    minority, majority = ids[:cut], ids[cut:]
    net.partition(minority)
    t = net.loop.run_until_true(
        lambda: all(all(net.hosts[m].swim.state_of(x) == swim.DEAD for x in minority)
                    for m in majority), 20.0, 0.1)
    assert t is not None, "the majority did not declare the minority dead"
    # The minority, probing 35 hosts with 5, takes longer to declare the majority dead.
    t = net.loop.run_until_true(
        lambda: all(net.hosts[x].swim.state_of(m) == swim.DEAD for x in minority
                    for m in majority), 30.0, 0.1)
    assert t is not None, "the minority did not declare the majority dead"
    deaths = {m: net.hosts[m].swim.counters.deaths for m in majority}
    net.heal()
    t = net.loop.run_until_true(lambda: everyone_sees_everyone(net), 30.0, 0.1)
    assert t is not None, "the minority did not rejoin"
    assert all(net.hosts[x].revivals >= 1 for x in minority)
    # The minority's stale view (the majority dead) did not spread: no majority host
    # saw another majority host die on the heal.
    assert {m: net.hosts[m].swim.counters.deaths for m in majority} == deaths


def test_replica_partners_notice_a_death_first_and_within_the_bound() -> None:
    n = 60
    net = simnet.cluster(n, seed=7, loss=0.01)
    net.loop.run_until(3.0)
    victim = "h0033"
    h = net.hosts[victim]
    partners = h._partners()
    assert len(partners) == 2
    t_kill = net.loop.now
    net.kill(victim)
    live = [x for x in net.hosts.values() if x.up]
    assert net.loop.run_until_true(lambda: all(victim in x.marked_dead for x in live),
                                   30.0, 0.05) is not None
    cfg = swim.SwimConfig()
    # A partner probes every partner_period and suspects a period after a probe that got
    # no answer; dead one suspicion timeout and one last unanswered ping later (plus
    # the ticks that drive the timers).
    bound = (cfg.partner_period + cfg.period + cfg.suspicion_timeout(n)
             + cfg.probe_deadline() + 3 * swim.TICK)
    first = min(x.marked_dead[victim] for x in live) - t_kill
    for p in partners:
        assert net.hosts[p].marked_dead[victim] - t_kill <= bound
    everyone = max(x.marked_dead[victim] for x in live) - t_kill
    assert first <= bound and everyone <= 10.0


def test_per_host_cost_does_not_grow_with_the_job() -> None:
    def messages_per_host_s(n: int) -> float:
        net = simnet.cluster(n, seed=11)
        net.loop.run_until(3.0)
        before = sum(h.sent.messages for h in net.hosts.values())
        net.loop.run_until(13.0)
        return (sum(h.sent.messages for h in net.hosts.values()) - before) / n / 10.0

    small, big = messages_per_host_s(20), messages_per_host_s(160)
    assert big < small * 1.3  # all-to-all health checks would be 8x


def test_a_host_whose_loop_runs_late_slows_down_and_recovers() -> None:
    """Lifeguard's local health: ticks that come late (the host's event loop was busy)
    raise its score, so it probes less often and gives its suspects longer; probes
    answered in time bring it back to normal."""
    a = swim.Swim("a", ["b", "c", "d"], swim.Recorder(), random.Random(2))
    t = 0.0

    def run(seconds: float, step: float) -> int:
        """Tick every `step` s; every ping is answered at once. Returns the probes."""
        nonlocal t
        probes = 0
        end = t + seconds
        while t < end:
            t += step
            for dst, m in a.tick(t):
                if m.kind == swim.PING:
                    probes += 1
                    a.on_message(dst, swim.Message(swim.ACK, seq=m.seq, target=dst), t)
        return probes

    healthy = run(20.0, swim.TICK)
    assert a.health == 0 and healthy >= 30, healthy
    busy = run(20.0, 0.5)  # every tick 0.45 s late
    assert a.health >= 4, a.health
    assert busy < healthy / 2, (busy, healthy)
    assert a.status()["late_ticks"] > 0
    # Unhealthy, it gives a suspect longer before declaring it dead.
    a.on_message("b", swim.Message(swim.GOSSIP, updates=(swim.Update("c", swim.SUSPECT, 0),)), t)
    cfg = swim.SwimConfig()
    assert a.members["c"].suspect_deadline - t >= cfg.suspicion_timeout(4) * 4
    a.on_message("c", swim.Message(swim.GOSSIP, incarnation=1), t)  # c refutes
    run(120.0, swim.TICK)
    assert a.health == 0
    assert all(a.state_of(n) == swim.ALIVE for n in "bcd")


def test_the_time_a_host_was_away_does_not_count_against_its_suspects() -> None:
    """Every host of a job starved at once (a save on few cores): a suspect's refutation
    is held up in other hosts' loops as long as the suspecting host's timers were in
    its own. A tick that comes late moves the suspects' deadlines by its lateness."""
    def suspecting(seed: int) -> tuple[swim.Swim, float]:
        a = swim.Swim("a", ["b", "c"], swim.Recorder(), random.Random(seed))
        a.tick(1.0)
        a.on_message("b", swim.Message(swim.GOSSIP, updates=(swim.Update("c", swim.SUSPECT,
                                                                          0),)), 1.0)
        assert a.state_of("c") == swim.SUSPECT
        return a, a.members["c"].suspect_deadline

    # On time: pinged a last time at its deadline, dead one probe later (no answer).
    a, deadline = suspecting(4)
    t = 1.0
    last_probe = swim.SwimConfig().probe_deadline() * (a.health + 1)  # (as unhealthy)
    while t < deadline + last_probe + swim.TICK:
        t += swim.TICK
        a.on_message("b", swim.Message(swim.ACK, seq=0, target="b"), t)  # (b answers)
        a.tick(t)
    assert a.state_of("c") == swim.DEAD
    assert a.status()["last_pings"] == 1
    # Away 10 s (its loop busy) past that deadline: still a suspect when it comes back,
    # so the refutation that comes next is in time.
    a, deadline = suspecting(4)
    late = a.status()["late_ticks"]
    back = deadline + 10.0
    a.tick(back)
    assert a.state_of("c") == swim.SUSPECT
    assert a.members["c"].suspect_deadline > back  # (moved by the ~12 s it was away)
    assert a.status()["late_ticks"] == late + 1
    a.on_message("c", swim.Message(swim.GOSSIP, incarnation=1), back + 0.1)
    assert a.state_of("c") == swim.ALIVE


def test_a_suspect_is_pinged_a_last_time_and_refutes_in_its_answer() -> None:
    """Every host starved at once: a suspect's refutation travels as gossip through
    other hosts' busy loops and may not come round before the suspicion runs out.
    Before its verdict the suspect gets one ping of the suspecting host's own, which
    carries the suspicion; its answer (a daemon's datagram thread answers at once)
    refutes it. One that does not answer is dead one probe later."""
    cfg = swim.SwimConfig()
    a = swim.Swim("a", ["b", "c"], swim.Recorder(), random.Random(4))
    a.tick(1.0)
    a.on_message("b", swim.Message(swim.GOSSIP, updates=(swim.Update("c", swim.SUSPECT,
                                                                      0),)), 1.0)
    deadline = a.members["c"].suspect_deadline
    t, last = 1.0, []
    while not last:
        t += swim.TICK
        assert t < deadline + 2 * swim.TICK, "no last ping at the deadline"
        out = a.tick(t)
        last = [m for dst, m in out if dst == "c" and m.kind == swim.PING
                and swim.Update("c", swim.SUSPECT, 0) in m.updates]
    assert t >= deadline and a.state_of("c") == swim.SUSPECT
    # c's answer: the ack at a higher incarnation (it refuted on reading the ping).
    a.on_message("c", swim.Message(swim.ACK, seq=last[0].seq, incarnation=1, target="c"),
                 t + 0.01)
    for _ in range(round(3 * cfg.probe_deadline() / swim.TICK)):
        t += swim.TICK
        a.tick(t)
    assert a.state_of("c") == swim.ALIVE and a.incarnation_of("c") == 1
    assert a.status()["deaths"] == 0 and a.status()["last_pings"] == 1
