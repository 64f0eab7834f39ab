"""Membership by SWIM: failure detection whose cost per host does not grow with the job.

A sans-IO state machine: it never sends, sleeps or reads a clock. The driver
(the in-process simulation, bench/scale.py, or a gRPC transport) hands it the
messages that arrive and the time, and sends what it returns:

    on_message(src, msg, now) -> [(dst, msg), ...]
    tick(now)                 -> [(dst, msg), ...]     (call every TICK seconds)

What it does (Das, Gupta, Motivala, "SWIM", DSN 2002, with the Lifeguard
refinements of HashiCorp memberlist where noted):

- Every `period` each host pings ONE member, round robin over a shuffled list
  (each member is probed once per pass). No ack within `ack_timeout`: it asks
  `indirect` other members to ping the target for it (PING_REQ); no ack by the
  end of the period: the target is SUSPECT.
- A suspect that does not refute within `suspicion_timeout` (grows with
  log10 N, as memberlist's) is pinged a last time, the suspicion carried in
  the ping, and is DEAD when that gets no answer by the probe deadline (a
  starved host's refutation spread as gossip may not come round in time; its
  answer to the last ping refutes). A host that hears it is suspected or dead
  refutes by raising its incarnation number: ALIVE at a higher incarnation
  overrides SUSPECT and DEAD at a lower one.
- Replica partners (the hosts this one replicates to and the hosts that
  replicate to it, from `partners`) are also probed every `partner_period`:
  they notice a partner's death first.
- Membership changes travel piggybacked on pings and acks, and on GOSSIP
  messages sent every `gossip_interval` to `gossip_fanout` random members while
  there is news; each change is sent at most `retransmit_mult * ceil(log2(N+1))`
  times, so its cost per host is O(log N) and it reaches everyone in O(log N)
  rounds.
- A dead member is pinged now and then (`dead_probe_interval`): a host that
  was cut off (a partition) learns it was declared dead, refutes, and rejoins.
- A starting host sends SYNC to one live host and gets the whole member list
  back (push-pull state sync, once).
- Local health (Lifeguard's local health multiplier): a host that sees signs
  that it is the slow one — it had to refute a suspicion of itself, or its
  driver called tick() late (its event loop was busy) — raises its health
  score (0 to `max_health`); each probe answered in time lowers it. (A probe
  that failed is not counted against it, as Lifeguard does when no nack came
  back: SWIM here has no nacks, and hosts probing a host that did die must
  not slow down.) Its probe interval, ack timeout, probe deadline and the
  time it gives its own suspects before declaring them dead are multiplied
  by score + 1: an overloaded host stops accusing healthy ones, and healthy
  hosts judge it on their own timers. And a late tick moves its suspects'
  deadlines by its lateness: the time it was away does not count.

So per host and per second: about 1/period + 1/partner_period probes, their
acks, and a bounded amount of gossip, whatever the number of hosts.
"""

from __future__ import annotations

import bisect
import math
import random
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

ALIVE, SUSPECT, DEAD = 0, 1, 2
STATE_NAMES = {ALIVE: "alive", SUSPECT: "suspect", DEAD: "dead"}

PING, ACK, PING_REQ, GOSSIP, SYNC, SYNC_REPLY = range(6)

# A member's incarnation starts at its start time in ms and refutations add 1: one
# that jumped this much (a second) is a restarted process.
RESTART_JUMP = 1000
TICK = 0.05  # the driver calls tick() this often: timers fire within one tick


@dataclass(frozen=True, slots=True)
class Update:
    """What one host believes about another: the unit of membership gossip."""

    node: str
    state: int
    incarnation: int


@dataclass(frozen=True, slots=True)
class Message:
    kind: int
    seq: int = 0
    incarnation: int = 0  # the sender's own incarnation
    target: str = ""  # PING_REQ: whom to ping; ACK: who answered
    updates: tuple[Update, ...] = ()


@dataclass(frozen=True)
class SwimConfig:
    period: float = 0.5
    partner_period: float = 0.25
    ack_timeout: float = 0.15
    indirect: int = 3  # members asked to ping a target that did not answer
    suspicion_mult: float = 2.0  # suspicion timeout = mult * max(1, log10 N) * period
    gossip_interval: float = 0.1
    gossip_fanout: int = 3
    retransmit_mult: int = 2
    max_piggyback: int = 24  # updates per message
    dead_probe_interval: float = 2.0
    max_health: int = 8  # local health score ceiling: timeouts stretch up to 9x
    late_tick: float = 0.25  # tick() this much later than TICK: this host is the slow one
    probe_timeout: float = 0.0  # no ack this long after a probe: SUSPECT (0: the period)

    def probe_deadline(self) -> float:
        return self.probe_timeout or self.period

    def suspicion_timeout(self, n: int) -> float:
        return self.suspicion_mult * max(1.0, math.log10(max(n, 1))) * self.period

    def retransmits(self, n: int) -> int:
        return self.retransmit_mult * math.ceil(math.log2(n + 1))


class SwimListener(Protocol):
    def member_alive(self, node: str) -> None: ...

    def member_dead(self, node: str) -> None: ...

    def member_restarted(self, node: str) -> None:
        """`node` came back in a new life (its incarnation, its start time in ms, jumped
        by RESTART_JUMP or more) without being declared dead here first."""

    def declared_dead(self) -> None:
        """Others declared this host dead (it was cut off, or too slow): it refuted, and
        must reconcile its index with a live host's, both ways (trees skipped it, and
        its own changes meanwhile reached only the hosts it saw)."""


@dataclass(slots=True)
class _Member:
    state: int
    incarnation: int
    suspect_deadline: float = 0.0
    asked: bool = False  # its suspicion ran out once: pinged a last time


# The configured members not heard of since the start share one record, copied
# before its first change (Swim._own): a job starts knowing thousands of hosts,
# and the simulation runs thousands of such hosts in one process.
_UNHEARD = _Member(ALIVE, 0)


@dataclass(slots=True)
class _Probe:
    target: str
    sent: float
    deadline: float  # suspect the target if no ack by then
    indirect_sent: bool = False
    evidence: bool = False  # word from outside that it is gone: no ack means dead at once


@dataclass(slots=True)
class _Relay:
    """A ping sent for another member's PING_REQ: its ack goes back to them."""

    requester: str
    seq: int
    expires: float


@dataclass
class Counters:
    messages_sent: int = 0
    probes: int = 0
    indirect_probes: int = 0
    suspicions: int = 0
    refutations: int = 0
    deaths: int = 0
    late_ticks: int = 0
    last_pings: int = 0  # suspects pinged a last time before the verdict
    death_news_dropped: int = 0  # a host we held dead spoke: our deaths news dropped


Out = list[tuple[str, Message]]


class Swim:
    def __init__(self, me: str, members: Iterable[str], listener: SwimListener,
                 rng: random.Random, config: SwimConfig | None = None,
                 partners: Callable[[], Iterable[str]] = tuple, now: float = 0.0,
                 incarnation: int = 0) -> None:
        """`members`: the job's other hosts as configured, taken to be alive at the start
        (a host that is not gets suspected within a period or two). `partners`: this
        host's replica partners, asked again each time they are probed. `incarnation`:
        where this host's starts (the daemon starts at its start time in ms, so that a
        restarted host overrides what others hold of its previous life at once)."""
        self.me = me
        self.incarnation = incarnation
        self._refuting = threading.Lock()  # refute() may be called from another thread
        self.config = config or SwimConfig()
        self.listener = listener
        self.rng = rng
        self.partners = partners
        self.members: dict[str, _Member] = {m: _UNHEARD for m in members if m != me}
        # Kept up to date on every change, so that no timer or batch scans all members:
        self._live = sorted(self.members)  # alive or suspect, by node id
        self._dead: set[str] = set()
        self._suspects: set[str] = set()
        self.counters = Counters()
        self._seq = 0
        self._order: list[str] = []  # this pass of the round robin
        self._probes: dict[int, _Probe] = {}
        self._relays: dict[int, _Relay] = {}
        self._news: dict[str, list] = {}  # node -> [update, times sent]
        self._resync = False  # declared dead: take the next live host's member list
        self._joining = False  # join() sent: take the seed's member list as it is
        self._resync_asked = -1e9
        self._partner_turn = 0
        self._next_probe = now + rng.random() * self.config.period
        self._next_partner_probe = now + rng.random() * self.config.partner_period
        if self.config.partner_period == self.config.period:
            # Both probes in one tick (a driver that sleeps between timers wakes once).
            self._next_partner_probe = self._next_probe
        self._next_gossip = now
        self._next_dead_probe = now + self.config.dead_probe_interval
        self.health = 0  # local health score (Lifeguard): 0 is healthy
        self._last_tick = now
        self._planned = -1.0  # when the driver said it would tick next (see next_due)

    # -- what the rest of the host asks ----------------------------------------------

    def incarnation_of(self, node: str) -> int:
        m = self.members.get(node)
        return self.incarnation if node == self.me else 0 if m is None else m.incarnation

    def state_of(self, node: str) -> int:
        if node == self.me:
            return ALIVE
        m = self.members.get(node)
        return DEAD if m is None else m.state

    def is_live(self, node: str) -> bool:
        """Alive or suspected: commits still count (and wait for) a suspect."""
        return self.state_of(node) != DEAD

    def live(self) -> list[str]:
        """The members alive or suspect, sorted by node id (the list itself: read only)."""
        return self._live

    def dead(self) -> list[str]:
        return sorted(self._dead)

    def size(self) -> int:
        """Members known, this host included (the N of log N)."""
        return len(self.members) + 1

    # -- joining ---------------------------------------------------------------------

    def join(self, seed: str) -> Out:
        """A starting host: ask one live host for the member list (adopted as it is,
        not spread again as news)."""
        self._joining = True
        return [self._send(seed, Message(SYNC, incarnation=self.incarnation,
                                         updates=(Update(self.me, ALIVE, self.incarnation),)))]

    def add(self, node: str) -> None:
        """A host added to the job's configuration: taken to be alive, probed as any."""
        if node != self.me and node not in self.members:
            self.members[node] = _Member(ALIVE, 0)
            bisect.insort(self._live, node)

    def remove(self, node: str) -> None:
        """A host no longer in the job's configuration: forgotten."""
        m = self.members.pop(node, None)
        if m is None:
            return
        if m.state != DEAD:
            self._live.pop(bisect.bisect_left(self._live, node))
        self._dead.discard(node)
        self._suspects.discard(node)
        self._news.pop(node, None)
        for seq in [s for s, p in self._probes.items() if p.target == node]:
            del self._probes[seq]

    def probe(self, node: str, now: float) -> Out:
        """Probe `node` now (a call to it failed), unless a probe of it is under way."""
        if self.state_of(node) != ALIVE or any(p.target == node for p in self._probes.values()):
            return []
        return [self._ping(node, now, self.config.probe_deadline())]

    def gone(self, node: str, now: float) -> Out:
        """Word from outside SWIM that `node` is gone (Kubernetes deleted its pod, its
        node was lost). Evidence, never the verdict: `node` is probed at once, and
        declared dead when that probe (indirect pings included) gets no ack by its
        deadline, without the suspicion period; a node that answers stays."""
        m = self.members.get(node)
        if m is None or m.state == DEAD:
            return []
        for p in self._probes.values():
            if p.target == node:
                p.evidence = True
                return []
        return [self._ping(node, now, self.config.probe_deadline(), evidence=True)]

    def hello(self, node: str) -> Out:
        """A plain ping (no probe: no suspicion follows): the receiver learns this host
        at its incarnation and answers with an ACK carrying its own."""
        return [self._send(node, Message(PING, seq=self._next_seq()))]

    # -- time ------------------------------------------------------------------------

    def _scale(self) -> int:
        return self.health + 1

    def _unhealthy(self) -> None:
        self.health = min(self.config.max_health, self.health + 1)

    def next_due(self, plan: bool = False) -> float:
        """The earliest time at which tick() has something to do: a driver that sleeps
        until then (or until a message comes) instead of ticking every TICK wakes only
        for work. plan=True: the driver sleeps until then, so a tick that comes much
        later than this (rather than than TICK after the last) is late."""
        cfg = self.config
        due = min(self._next_probe, self._next_partner_probe)
        if self._dead:
            due = min(due, self._next_dead_probe)
        if self._news:
            due = min(due, self._next_gossip)
        scale = self._scale()
        for p in self._probes.values():
            due = min(due, p.deadline if p.indirect_sent
                      else min(p.deadline, p.sent + cfg.ack_timeout * scale))
        for r in self._relays.values():
            due = min(due, r.expires)
        for node in self._suspects:
            due = min(due, self.members[node].suspect_deadline)
        if plan:
            self._planned = due
        return due

    def tick(self, now: float) -> Out:
        out: Out = []
        cfg = self.config
        expected = self._planned if self._planned > self._last_tick else self._last_tick + TICK
        if now - expected > cfg.late_tick:
            self.counters.late_ticks += 1
            self._unhealthy()
            # The time this host was away (its loop busy) does not count against its
            # suspects: when every host is starved at once, their refutations were
            # held up in others' loops as long as our timers were in ours.
            for node in self._suspects:
                self.members[node].suspect_deadline += now - expected
        self._last_tick = now
        scale = self._scale()
        if now >= self._next_probe:
            self._next_probe = now + cfg.period * scale
            target = self._next_target()
            if target:
                out.append(self._ping(target, now, cfg.probe_deadline() * scale))
        if now >= self._next_partner_probe:
            self._next_partner_probe = now + cfg.partner_period * scale
            target = self._next_partner()
            if target and not any(p.target == target for p in self._probes.values()):
                out.append(self._ping(target, now, cfg.probe_deadline() * scale))
        if now >= self._next_dead_probe:
            self._next_dead_probe = now + cfg.dead_probe_interval
            if self._dead:
                # Not a probe (no suspicion follows): a cut-off host learns it is dead.
                out.append(self._send(self.rng.choice(self.dead()),
                                      Message(PING, seq=self._next_seq())))
        for seq, p in list(self._probes.items()):
            if now >= p.deadline:
                del self._probes[seq]
                m = self.members.get(p.target)
                if p.evidence and m is not None and m.state != DEAD:
                    self._learn(Update(p.target, DEAD, m.incarnation), now)
                else:
                    self._suspect(p.target, now)
            elif not p.indirect_sent and now >= p.sent + cfg.ack_timeout * scale:
                p.indirect_sent = True
                out += self._ping_req(seq, p.target)
        for seq, r in list(self._relays.items()):
            if now >= r.expires:
                del self._relays[seq]
        for node in [n for n in self._suspects if now >= self.members[n].suspect_deadline]:
            m = self.members[node]
            if m.asked:
                self._learn(Update(node, DEAD, m.incarnation), now)
                continue
            # Before the verdict, one ping of its own, which carries the suspicion: a
            # host whose refutation is stuck in other hosts' busy loops (every host
            # starved at once by a save) refutes in its answer, at once; a dead one
            # is dead one probe later.
            m.asked = True
            within = cfg.probe_deadline() * scale
            m.suspect_deadline = now + within
            self.counters.last_pings += 1
            if not any(p.target == node for p in self._probes.values()):
                out.append(self._ping(node, now, within, evidence=True))
        if self._news and now >= self._next_gossip:
            self._next_gossip = now + cfg.gossip_interval
            live = self._live
            for dst in self.rng.sample(live, min(cfg.gossip_fanout, len(live))):
                out.append(self._send(dst, Message(GOSSIP)))
        return out

    def _next_target(self) -> str:
        while True:
            if not self._order:
                self._order = list(self._live)
                self.rng.shuffle(self._order)
                if not self._order:
                    return ""
            t = self._order.pop()
            if self.is_live(t):
                return t

    def _next_partner(self) -> str:
        live = [p for p in self.partners() if p != self.me and self.is_live(p)]
        if not live:
            return ""
        self._partner_turn = (self._partner_turn + 1) % len(live)
        return live[self._partner_turn]

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _ping(self, target: str, now: float, within: float,
              evidence: bool = False) -> tuple[str, Message]:
        seq = self._next_seq()
        self._probes[seq] = _Probe(target, now, now + within, evidence=evidence)
        self.counters.probes += 1
        return self._send(target, Message(PING, seq=seq))

    def _ping_req(self, seq: int, target: str) -> Out:
        live = self._live
        k = min(self.config.indirect + 1, len(live))
        helpers = [n for n in self.rng.sample(live, k) if n != target][:self.config.indirect]
        self.counters.indirect_probes += len(helpers)
        return [self._send(h, Message(PING_REQ, seq=seq, target=target)) for h in helpers]

    # -- messages --------------------------------------------------------------------

    def on_message(self, src: str, msg: Message, now: float) -> Out:
        # A sender we hold dead was cut off (or is a previous life): its view of others
        # is stale, and its suspicions and deaths would make live hosts flap.
        trusted = self.state_of(src) != DEAD
        held = self.members.get(src)
        if not trusted and held is not None and 0 <= msg.incarnation <= held.incarnation:
            # ... and the life we declared dead speaks: a partition healed (not a restart,
            # which comes at a new incarnation). The deaths we saw meanwhile may be of
            # its side, alive: not news for others (real ones are found again by probes),
            # or once trusted we would spread them and make live hosts flap.
            self._forget_deaths()
        # The sender is alive at its incarnation (this is how a joining host is learnt).
        self._learn(Update(src, ALIVE, msg.incarnation), now)
        if msg.kind == SYNC_REPLY and (self._resync or self._joining):
            self._joining = False
            self._adopt(msg.updates, now)
            return []
        for u in msg.updates:
            if trusted or u.state == ALIVE or u.node == self.me:
                self._learn(u, now)
        out = self._answer(src, msg, now, trusted)
        if (self._resync and now >= self._resync_asked + self.config.period
                and (trusted or len(self._live) + 1 < len(self._dead))):
            # Back from the dead: take the member list of the first host that speaks;
            # one of our side, unless ours is the smaller (each side of a healed
            # partition was declared dead by the other: a host of the larger one
            # taking the smaller one's view would mark its own side dead).
            self._resync_asked = now
            out.append(self._send(src, Message(SYNC)))
        return out

    def _adopt(self, updates: tuple[Update, ...], now: float) -> None:
        """A host back from the dead takes a live host's view as it is (its own was
        formed while it was cut off: everyone else dead)."""
        self._resync = False
        for u in updates:
            if u.node == self.me:
                self._learn(u, now)
                continue
            m = self.members.get(u.node)
            if m is None:
                self._learn(u, now)
                continue
            m = self._own(u.node, m)
            was = m.state
            m.state, m.incarnation = u.state, u.incarnation
            self._index(u.node, was, u.state)
            if u.state == SUSPECT:
                m.suspect_deadline = now + self.config.suspicion_timeout(self.size())
                m.asked = False
            if was == DEAD and u.state != DEAD:
                self.listener.member_alive(u.node)
            elif u.state == DEAD and was != DEAD:
                self.listener.member_dead(u.node)

    def _answer(self, src: str, msg: Message, now: float, trusted: bool) -> Out:
        kind = msg.kind
        if kind == PING:
            return [self._send(src, Message(ACK, seq=msg.seq, target=self.me))]
        if kind == ACK:
            relay = self._relays.pop(msg.seq, None)
            if relay is not None:
                return [self._send(relay.requester,
                                   Message(ACK, seq=relay.seq, target=msg.target))]
            probe = self._probes.get(msg.seq)
            if probe is not None and probe.target == msg.target:
                del self._probes[msg.seq]
                if now <= probe.deadline:
                    self.health = max(0, self.health - 1)
            return []
        if kind == PING_REQ:
            seq = self._next_seq()
            self._relays[seq] = _Relay(src, msg.seq, now + self.config.period)
            return [self._send(msg.target, Message(PING, seq=seq))]
        if kind == SYNC:
            if self._resync and not trusted:
                # Back from the dead ourselves, and the asker is of the other side (we
                # held it dead): our view is stale (its side dead), and taking it, it
                # would mark its own side dead. It asks the next host it hears from.
                # (Hosts of one side answer each other: both may be resyncing.)
                return []
            everyone = [Update(n, m.state, m.incarnation) for n, m in self.members.items()]
            everyone.append(Update(self.me, ALIVE, self.incarnation))
            return [(src, Message(SYNC_REPLY, incarnation=self.incarnation,
                                  updates=tuple(everyone)))]
        return []  # GOSSIP, SYNC_REPLY: the updates were all

    def _own(self, node: str, m: _Member) -> _Member:
        """`node`'s record, this host's own (not the shared one) before it changes."""
        if m is _UNHEARD:
            m = self.members[node] = _Member(ALIVE, 0)
        return m

    def _forget_deaths(self) -> None:
        for node in [n for n, (v, _) in self._news.items() if v.state != ALIVE]:
            del self._news[node]
        self.counters.death_news_dropped += 1

    def refute(self, u: Update) -> bool:
        """If `u` suspects this host at its incarnation: take a higher one at once; the
        next message it sends refutes (its receivers learn the incarnation and spread
        it). The only call allowed from another thread: a daemon's datagram thread
        refutes while its event loop is busy (mtcfs.peer.membership.QuickAcks)."""
        with self._refuting:
            if u.node != self.me or u.state != SUSPECT or u.incarnation < self.incarnation:
                return False
            self.incarnation = u.incarnation + 1
            self.counters.refutations += 1
            return True

    def _learn(self, u: Update, now: float) -> None:
        if u.node == self.me:
            with self._refuting:  # (not to go back below what refute() took)
                refute = (u.state != ALIVE and u.incarnation >= self.incarnation
                          or u.incarnation > self.incarnation)
                if refute:
                    self.incarnation = u.incarnation + 1
            if refute:
                # Suspected or declared dead (or a previous life was alive at a higher
                # incarnation): refute with a higher incarnation.
                self.counters.refutations += 1
                self._unhealthy()  # others found us slow
                self._spread(Update(self.me, ALIVE, self.incarnation))
                if u.state == DEAD and not self._resync:
                    # Cut off: the deaths it saw meanwhile are not news for others,
                    # and its view is resynced from the first live host it hears.
                    self._forget_deaths()
                    self._resync = True
                    self._resync_asked = -1e9
                    self.listener.declared_dead()
            return
        m = self.members.get(u.node)
        if m is None:
            self.members[u.node] = m = _Member(DEAD, -1)
            self._dead.add(u.node)
            if u.state == DEAD:
                m.incarnation = u.incarnation
                return
        if u.state == ALIVE:
            newer = u.incarnation > m.incarnation
        elif u.state == SUSPECT:
            newer = (u.incarnation >= m.incarnation if m.state == ALIVE
                     else u.incarnation > m.incarnation)
        else:
            newer = m.state != DEAD and u.incarnation >= m.incarnation
        if not newer:
            return
        m = self._own(u.node, m)
        was, was_incarnation = m.state, m.incarnation
        m.state, m.incarnation = u.state, u.incarnation
        self._index(u.node, was, u.state)
        if u.state == SUSPECT:
            # An unhealthy host gives its suspects longer: it may be the slow one.
            m.suspect_deadline = now + self.config.suspicion_timeout(self.size()) * \
                self._scale()
            m.asked = False
        self._spread(u)
        if was == DEAD and u.state != DEAD:
            self.listener.member_alive(u.node)
        elif (u.state == ALIVE and was_incarnation > 0  # (0: not heard of yet)
              and u.incarnation - was_incarnation >= RESTART_JUMP):
            self.listener.member_restarted(u.node)
        elif u.state == DEAD:
            self.counters.deaths += 1
            for seq in [s for s, p in self._probes.items() if p.target == u.node]:
                del self._probes[seq]
            self.listener.member_dead(u.node)

    def _index(self, node: str, was: int, now: int) -> None:
        if now == SUSPECT:
            self._suspects.add(node)
        else:
            self._suspects.discard(node)
        if (was == DEAD) == (now == DEAD):
            return
        if now == DEAD:
            self._dead.add(node)
            self._live.pop(bisect.bisect_left(self._live, node))
        else:
            self._dead.discard(node)
            bisect.insort(self._live, node)

    def _suspect(self, node: str, now: float) -> None:
        m = self.members.get(node)
        if m is not None and m.state == ALIVE:
            self.counters.suspicions += 1
            self._learn(Update(node, SUSPECT, m.incarnation), now)

    def _spread(self, u: Update) -> None:
        self._news[u.node] = [u, 0]

    def _send(self, dst: str, msg: Message) -> tuple[str, Message]:
        """Stamp our incarnation and piggyback news: what we hold against `dst` first
        (so a host suspected or declared dead hears it and refutes), then the least
        sent updates."""
        updates: list[Update] = []
        m = self.members.get(dst)
        if m is not None and m.state != ALIVE:
            updates.append(Update(dst, m.state, m.incarnation))
        if self._news:
            limit = self.config.retransmits(self.size())
            room = self.config.max_piggyback - len(updates)
            news = sorted(self._news.values(), key=lambda n: n[1])[:room]
            for item in news:
                u = item[0]
                if u.node != dst or u.state == ALIVE:
                    updates.append(u)
                item[1] += 1
                if item[1] >= limit:
                    del self._news[u.node]
        self.counters.messages_sent += 1
        return dst, Message(msg.kind, msg.seq, self.incarnation, msg.target,
                            msg.updates + tuple(updates))

    def status(self) -> dict[str, object]:
        return {
            "incarnation": self.incarnation,
            "health": self.health,
            "alive": len(self._live) - len(self._suspects) + 1,
            "suspect": len(self._suspects),
            "dead": len(self._dead),
            "news": len(self._news),
            **{k: v for k, v in vars(self.counters).items()},
        }


@dataclass
class Recorder:
    """A SwimListener that keeps what it heard (tests, the simulation)."""

    alive: list[tuple[str, float]] = field(default_factory=list)
    dead: list[tuple[str, float]] = field(default_factory=list)
    revived: list[float] = field(default_factory=list)
    restarted: list[tuple[str, float]] = field(default_factory=list)
    clock: Callable[[], float] = lambda: 0.0

    def member_alive(self, node: str) -> None:
        self.alive.append((node, self.clock()))

    def member_dead(self, node: str) -> None:
        self.dead.append((node, self.clock()))

    def member_restarted(self, node: str) -> None:
        self.restarted.append((node, self.clock()))

    def declared_dead(self) -> None:
        self.revived.append(self.clock())
