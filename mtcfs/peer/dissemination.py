"""Getting this host's index changes to every host, and knowing when they arrived.

The daemon's driver of mtcfs.peer.fanout (the sans-IO tree the 1,000-host
simulation runs): a batch of this host's changes goes to at most FANOUT
hosts, each of which applies it and forwards it to at most FANOUT others of
its range of the ring of live hosts (by address), so a host's cost per
batch does not grow with the number of hosts. Acks go back up the tree once
a host and its whole subtree applied the batch, so the writer knows when
every live host has it. That is the commit rule (`wait_applied`): fsync, a
directory fsync and the rename or close that commits a step return only once
every live host has applied everything this host published before the call
(bounded by --commit-timeout).

"Every live host" counts hosts alive and hosts configured but not known to be
dead yet (never reached, or not yet declared dead by SWIM): a fresh mount
does not treat a peer that has not answered yet as absent. A child that does
not ack gets the batch again (backing off); one declared dead has its range
re-split among the range's live hosts. Nothing is queued for a host that is
away: routers resend what they routed without it if it is back within
fanout.REPAIR_WINDOW, and otherwise it catches up by snapshot (the peer
tier's catch-up when a host comes back).

Changes are coalesced into batches (up to MAX_BATCH entries): a batch leaves
when its first change is due (mtcfs.peer.outbox: 20 ms for a change, 2 s
for an announcement of a copy; while a batch of this host's is on its way, up
to BUSY_HOLD later), when MAX_BATCH entries wait, or when a commit waits. A
thousand changes made one by one cost a few batches, not a thousand trees, and
a step's files a batch or two. Runs in the daemon's trio thread; a message is
sent through a TreeTransport, never waited for: a frame on a stream over the
data channel (mtcfs.peer.treelinks), or a gRPC call made from a thread of its
own (TreeCalls; a forward's reply may carry its range's ack: Reply).
"""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import grpc
import trio

from mtcfs.peer import fanout, grouped, wire
from mtcfs.peer.membership import Membership
from mtcfs.peer.outbox import Outbox
from mtcfs.peer.v1 import peer_pb2 as pb
from mtcfs.peer.v1 import peer_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

MAX_BATCH = 500  # entries per batch: each batch is applied in one go
BROADCAST_TIMEOUT = 5.0  # seconds a tree message's call may take
DEGREE = fanout.FANOUT  # hosts a host forwards a batch to (read when a tier is made)
TICK = 0.05  # seconds between retries' checks
# Seconds a batch that is due waits at most for one of ours on its way to complete.
BUSY_HOLD = 1.0
KERNEL_SETTLE = 0.1  # seconds an ack waits for the kernel notifications of its batch
# A message whose call failed is sent again after RESEND (at most RESENDS times); one
# whose call succeeded was handed to the receiver (gRPC runs over TCP), so the tree's
# own timer only guards against what is lost after that (a receiver that died).
RESEND = 0.1
RESENDS = 3
# Then 10, 20 and 40 s: under load a subtree waits for hosts that are slow, not lost,
# and resending its batch every 10 s to every child multiplied the load (a retry storm
# that kept 64 daemons on two cores from settling).
TREE_RETRY = 5.0
TREE_BACKOFF = 3
# Seconds between checks that nothing waits in the outbox long past its time, and how
# far past it (beyond BUSY_HOLD) counts as stuck: see _guard.
GUARD = 2.0


class Reply:
    """A forward's gRPC handler waiting for the ack of the range it delivered: given
    in the call's reply if it comes in time (one call per tree edge, not two), else
    sent as a call of its own. Fulfilled in the trio thread, claimed in gRPC's."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._abandoned = False

    def fulfil(self) -> bool:
        """The range is acked: False if the handler gave up (send the ack instead)."""
        with self._lock:
            if self._abandoned:
                return False
            self._event.set()
            return True

    @property
    def abandoned(self) -> bool:
        return self._abandoned

    def wait(self, timeout: float) -> bool:
        """In the handler's thread: True if acked in time; else the ack is sent later."""
        self._event.wait(timeout)
        with self._lock:
            if self._event.is_set():
                return True
            self._abandoned = True
            return False


class Clocked(Protocol):
    """The index whose changes go out: its Lamport clock stamps each batch."""

    clock: int


class Inbox(Protocol):
    """Where another host's batch is applied here (mtcfs.peer.remote)."""

    def deliver(self, batch: pb.ChangeBatch) -> None: ...


class Settles(Protocol):
    """The kernel's caches (mtcfs.fs.kernel)."""

    def when_settled(self, callback: Callable[[], None]) -> None:
        """Call `callback` (from any thread) once the kernel dropped what it caches of
        the names applied so far: a wait that holds no thread."""
        ...


class TreeTransport(Protocol):
    """How a tree message reaches a host: TreeCalls (gRPC), or mtcfs.peer.treelinks
    (streams on the data channel, gRPC behind them)."""

    def forward(self, addr: str, msg: object, outcome: Outcome) -> bool:
        """Send `msg` to `addr`: True if it counts as delivered at once (`outcome`
        then told only of a failure), False if `outcome` tells how its call went."""
        ...

    def gone(self, addr: str) -> None:
        """`addr` was declared dead, or restarted: what waits on its way there is
        dropped (the tree resends what it must), so that nothing held up by a cut
        (a stream's unacknowledged bytes, in TCP's backoff) delays what comes
        once it is back."""
        ...

    def close(self) -> None: ...
    def status(self) -> dict[str, int]: ...


class TreeCalls:
    """One tree message to one host: a one-way gRPC `Forward` call, not waited for
    (a lost one is sent again by the tree), so the trio thread never blocks on a
    peer. Its reply says whether the receiver's range acked in it.

    The calls are made from one sending thread of their own, never from the trio
    thread: grpc starts a thread for a channel with no call in flight (its
    completion-queue spinner) at each such call, and `Thread.start` waits until
    the new thread runs. On the trio thread that was a third of its busy time
    during a save at 16 hosts, and under CPU pressure (many daemons, or a
    trainer's data loaders, on few cores) a wait for the scheduler in the thread
    that answers SWIM's probes and serves FUSE."""

    def __init__(self, members: Membership) -> None:
        self.members = members
        self._queue: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False
        self.calls = 0

    def status(self) -> dict[str, int]:
        return {"by_grpc": self.calls}

    def forward(self, addr: str, msg: object, outcome: Outcome) -> bool:
        """Send `msg` to `addr`; `outcome` gets the reply, or None if the call failed,
        and whether it failed for its deadline (in the sending thread or a gRPC
        thread, later). False: not delivered yet."""
        self.calls += 1
        with self._lock:
            if self._closed:
                return False
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tree-calls",
                                                daemon=True)
                self._thread.start()  # once, at the first message
        # The stub here: the membership's peers are the trio thread's.
        self._queue.put(_Call(self.members.stub_for(addr), msg, outcome))
        return False

    def gone(self, addr: str) -> None:
        """(Each call has its deadline: nothing to drop.)"""

    def close(self) -> None:
        with self._lock:
            self._closed = True
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout=2)

    def _run(self) -> None:
        while (c := self._queue.get()) is not None:
            try:
                call = c.stub.Forward.future(
                    wire.tree_to_pb(self.members.me, c.msg), timeout=BROADCAST_TIMEOUT,
                    metadata=self.members.metadata)
            except Exception as e:  # a closed channel (the peer left), a bad message
                log.debug("tree message: %s", e)
                c.outcome(None, False)
                continue
            call.add_done_callback(partial(_done, c.outcome))


Outcome = Callable[[pb.TreeReply | None, bool], None]


@dataclass
class _Call:
    stub: pb_grpc.PeerStub
    msg: object
    outcome: Outcome


def _done(outcome: Outcome, call: grpc.Future) -> None:
    e = call.exception()
    if e is None:
        outcome(call.result(), False)
    else:
        late = isinstance(e, grpc.Call) and e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        outcome(None, late)


def failed_attempt(msg: object, late: bool, attempt: int) -> int:
    """The attempt a failed call counts as (quick resends follow below RESENDS). A
    forward whose deadline passed at a busy receiver, which may well have it queued,
    counts as the last: no quick resends pile onto it, and the tree's own timer
    (backing off) resends it if no ack comes."""
    return RESENDS if late and isinstance(msg, fanout.Forward) else attempt


@dataclass
class Stats:
    batches_sent: int = 0  # this host's batches published
    entries_sent: int = 0
    waits: int = 0
    wait_seconds: float = 0.0
    max_wait: float = 0.0
    timeouts: int = 0
    last_timeout: str = ""  # the peers that did not answer in time, as logged
    acks_in_replies: int = 0  # acks that rode on a forward's reply
    acks_received_in_replies: int = 0
    send_errors: int = 0  # tree messages whose call failed
    overdue_flushes: int = 0  # times the guard sent overdue entries (Broadcaster._guard)


class Broadcaster:
    def __init__(self, members: Membership, node_id: str, index: Clocked, outbox: Outbox,
                 calls: TreeTransport, inbox: Inbox, kernel: Settles, commit_timeout: float,
                 degree: int | None = None, group: int = 0,
                 turn: Callable[[], int] = grouped.no_turn) -> None:
        """`outbox`: this host's changes waiting to go (the index puts them there);
        `calls`: one message to one host; `inbox`: another host's batch applied here;
        `kernel`: settled before an ack says "applied here"; `group`: hosts per
        group whose leader carries their batches (mtcfs.peer.grouped; 0: its
        choice, 1: every batch down a tree of its writer's own); `turn`: which
        host of a group leads (grouped.wall_turn)."""
        self.members = members
        self.node_id = node_id
        self.index = index
        self.outbox = outbox
        self.calls = calls
        self._deliver = inbox.deliver
        self._kernel = kernel
        self.commit_timeout = commit_timeout
        self.stats = Stats()
        # Numbered from the start time in µs: never a number of a previous life's.
        self.tree = grouped.GroupedFanout(members.me, self.counted, self._apply,
                                          group=group, fanout=degree or DEGREE, turn=turn,
                                          retry=TREE_RETRY, max_backoff=TREE_BACKOFF,
                                          first_seq=time.time_ns() // 1000)
        self._nursery: list[trio.Nursery] = []  # where resends run, once it runs
        # Forward handlers waiting for their range's ack: (origin, seq, end, parent).
        self._replies: dict[tuple[str, int, str, str], list[Reply]] = {}
        self._progress = trio.Event()  # set on every completed batch and membership change
        self._acks: list[tuple[str, object]] = []  # acks and "carried": settle first
        self._gathering = trio.Event()  # set when this host gathers batches to carry
        self._carry_until = math.inf  # ... or when they are due sooner than _carry sleeps
        self._acks_ready = trio.Event()
        self._flying = trio.Event()  # set when a batch may be in flight: retries to watch
        self._unsettled = False  # a batch applied since the kernel last settled
        self._loop_at = "not started"  # where run() is (logged by _guard)
        self._counted: list[str] = []  # the hosts of the trees: sorted addresses
        self._counted_version = -1
        self._known: set[str] = set()  # the counted hosts as of the last kick
        # Observers (metrics): called with the seconds a commit waited.
        self.observers: list[Callable[[float], None]] = []

    def stop(self) -> None:
        """No more messages (the tier is stopping): ends the sending thread."""
        self.calls.close()

    # -- the hosts of the trees --------------------------------------------------------

    def counted(self) -> list[str]:
        """The other hosts a batch goes to and a commit waits for, sorted: alive, or
        configured and not known dead yet."""
        version = self.members.version
        if version != self._counted_version:
            self._counted_version = version
            self._counted = sorted(a for a, p in self.members.peers.items()
                                   if not p.removed and not p.dead)
        return self._counted

    def kick(self) -> None:
        """Membership changed: re-split the ranges of hosts now dead, resend to hosts
        back, and re-check the commits waiting."""
        before, after = self._known, set(self.counted())
        self._known = after
        now = time.monotonic()
        out: grouped.Out = []
        for addr in sorted(before - after):
            self.calls.gone(addr)
            out += self.tree.dead(addr, now)
        for addr in sorted(after - before):
            out += self.tree.alive(addr, now)
        self._emit(out)
        self._notify()

    def restarted(self, addr: str) -> None:
        """`addr` is a new process: batches its previous life took are sent again now."""
        self.calls.gone(addr)
        self._emit(self.tree.restarted(addr, time.monotonic()))

    # -- publishing --------------------------------------------------------------------

    def publish(self, entries: list[pb.Entry]) -> None:
        """Queue entries for every host: they leave in the next batch (see above)."""
        self.outbox.put(entries)

    def announce(self, marker: pb.CaughtUp) -> None:
        """A catch-up marker (mtcfs.peer.catchup) in a batch of its own, after
        everything published before it."""
        self._flush()
        self._publish(pb.ChangeBatch(from_node=self.node_id, lamport=self.index.clock,
                                     caught_up=marker))
        self._notify()

    def announce_caught_up(self, hosts: list[str], since_unix: float) -> None:
        """This host caught up with `hosts` from `since_unix` on, for its side."""
        self.announce(pb.CaughtUp(hosts=hosts, since_unix=since_unix))

    async def settled(self, what: str) -> bool:
        """The commit rule for what this host republished: True once every live host
        applied it (False: some did not within --commit-timeout)."""
        return not await self.wait_applied(what)

    def _flush(self, waited: bool = False) -> None:
        """Everything waiting, in batches (`waited`: a commit waits for them)."""
        while self.outbox.count():
            self._publish(pb.ChangeBatch(from_node=self.node_id, lamport=self.index.clock,
                                         entries=self.outbox.take(MAX_BATCH), waited=waited))
        self._notify()  # a batch to no one (no other host) is complete at once

    def _publish(self, batch: pb.ChangeBatch) -> None:
        # A catch-up marker goes down this host's own tree (a leader's bundle carries
        # none); so does a full batch (a catch-up's republication): a tree of its own
        # costs it little, and its bytes do not travel twice.
        own = batch.HasField("caught_up") or len(batch.entries) >= MAX_BATCH
        _, out = self.tree.publish(batch, batch.ByteSize(), time.monotonic(), own_tree=own,
                                   urgent=batch.waited)
        self.stats.batches_sent += 1
        self.stats.entries_sent += len(batch.entries)
        self._emit(out)

    def pending(self) -> int:
        """Entries of this host's not yet on every host."""
        return self.outbox.count() + sum(len(b.entries) for b in self.tree.own_in_flight()
                                       if isinstance(b, pb.ChangeBatch))

    def quiet(self) -> bool:
        """Nothing of this host's on its way."""
        return not self.outbox.count() and self.caught_up()

    async def changes_out(self, timeout: float) -> None:
        """Until this host's changes (not its announcements of copies) have reached
        every live host, or `timeout` seconds."""
        with trio.move_on_after(timeout):
            while self.outbox.changes or not self.caught_up():
                await self._progress.wait()

    def caught_up(self) -> bool:
        """Every batch this host published has reached every live host."""
        return self.tree.completed >= self.tree.published()

    # -- messages ----------------------------------------------------------------------

    def on_message(self, src: str, msg: object, reply_wanted: bool = True) -> Reply | None:
        """A forward or an ack from `src`, or a hand-over or its answer (in the trio
        thread, from the server). For a forward over gRPC: the Reply its handler may
        wait on for the range's ack (a stream's sender takes none: `reply_wanted`)."""
        reply = None
        if reply_wanted and isinstance(msg, fanout.Forward):
            reply = Reply()
            self._replies.setdefault((msg.origin, msg.seq, msg.end, src), []).append(reply)
        self._emit(self.tree.on_message(src, msg, time.monotonic()))
        if isinstance(msg, fanout.Ack | grouped.Carried):
            self._notify()
        return reply

    def delivered(self, child: str, msg: object) -> None:
        """A call to `child` returned without an ack: `child` has the batch (a forward's
        ack will come as a call of its own; a hand-over's "carried" too: trio
        thread)."""
        self.tree.delivered(child, msg)

    def acked_in_reply(self, child: str, msg: object) -> None:
        """A forward's reply said `child`'s range applied it: its ack (trio thread)."""
        if isinstance(msg, fanout.Forward):
            self.stats.acks_received_in_replies += 1
            ack = fanout.Ack(msg.origin, msg.seq, child, msg.end)
            self._emit(self.tree.on_message(child, ack, time.monotonic()))
            self._notify()

    def _apply(self, parts: Sequence[grouped.Part], bundle: grouped.Bundle | None) -> None:
        """Other hosts' batches applied here: a bundle's in one go (one transaction), as
        received if this host's own is not among them."""
        if len(parts) == 1:
            batch = parts[0].payload
        elif bundle is not None and parts is bundle.parts and isinstance(
                bundle.encoded, pb.ChangeBatch):
            batch = bundle.encoded
        else:
            batch = pb.ChangeBatch(from_node=self.node_id,
                                   entries=[e for p in parts for e in p.payload.entries])
        assert isinstance(batch, pb.ChangeBatch)
        self._deliver(batch)
        self._unsettled = True

    def _emit(self, out: grouped.Out) -> None:
        if out or self._replies or self.tree.busy():
            self._flying.set()
        if self.tree.flush_at is not None and self.tree.flush_at < self._carry_until:
            self._gathering.set()
        for dst, msg in out:
            if isinstance(msg, grouped.Carried):
                self._acks.append((dst, msg))  # "carried": applied here too (see run)
                self._acks_ready.set()
            elif isinstance(msg, fanout.Ack):
                waiting = self._replies.pop((msg.origin, msg.seq, msg.end, dst), [])
                if sum(r.fulfil() for r in waiting):
                    self.stats.acks_in_replies += 1
                    continue  # the reply carries it (its handler settles the kernel)
                # "Applied here" once the kernel let go of the old names (see run).
                self._acks.append((dst, msg))
                self._acks_ready.set()
            else:
                self._send(dst, msg, 0)

    def _notify(self) -> None:
        self._progress.set()
        self._progress = trio.Event()

    # -- the commit rule ---------------------------------------------------------------

    async def wait_applied(self, what: str) -> list[str]:
        """Return once every counted host has applied everything published so far, or
        after the commit timeout; returns the hosts that did not answer (logged)."""
        self._flush(waited=True)
        mark = self.tree.published()
        if self.tree.completed >= mark:
            return []  # everything already applied everywhere: the common case is free
        t0 = time.monotonic()
        with trio.move_on_after(self.commit_timeout):
            while self.tree.completed < mark:
                await self._progress.wait()
        took = time.monotonic() - t0
        self.stats.waits += 1
        self.stats.wait_seconds += took
        self.stats.max_wait = max(self.stats.max_wait, took)
        for observe in self.observers:
            observe(took)
        if self.tree.completed >= mark:
            return []
        names = []
        for addr in sorted(self.tree.waiting_on(mark)):
            p = self.members.peers.get(addr)
            names.append(f"{(p.node_id if p else '') or '?'} ({addr})")
        self.stats.timeouts += 1
        self.stats.last_timeout = ", ".join(names)
        log.error("%s: returned after --commit-timeout %.1f s; these peers (or a host they "
                  "forward to) did not answer and may not see it yet: %s", what,
                  self.commit_timeout, ", ".join(names))
        return names

    # -- the loop ----------------------------------------------------------------------

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery.append(nursery)
            nursery.start_soon(self._send_acks)
            nursery.start_soon(self._retry)
            nursery.start_soon(self._carry)
            nursery.start_soon(self._guard)
            while True:
                self._loop_at = "waiting for changes"
                await self.outbox.wait()
                self._loop_at = "gathering"
                # Let the changes made together gather until the first of them is due
                # (mtcfs.peer.outbox), and while a batch of ours is on its way (up to
                # BUSY_HOLD more): the busier the hosts, the slower a batch completes and
                # the more the next one carries, instead of a batch per change that
                # loads them further. A commit flushes at once (wait_applied).
                while 0 < self.outbox.count() < MAX_BATCH:
                    due = self.outbox.due
                    if not self.caught_up():
                        due += BUSY_HOLD
                    wait = due - time.monotonic()
                    if wait <= 0:
                        break
                    await self._changed(wait)
                self._loop_at = "sending"
                self._flush()

    async def _guard(self) -> None:
        """Sends what waits in the outbox long past its time, and says so: a change
        that never leaves keeps every other host from seeing it and this host from
        being quiet (replication never done, `mtcfs umount` waiting). The loop above
        sends everything when due; this catches a path that left entries without
        waking it, logging what waited so that the path can be found."""
        while True:
            slept = time.monotonic()
            await trio.sleep(GUARD)
            if time.monotonic() - slept > GUARD + BUSY_HOLD:
                # The whole process stood still (SIGSTOP, a starved CPU): the loop's
                # timer ran out meanwhile too, and it sends as soon as it runs. Not a
                # lost wake; judged at the next check (a chaos run's SIGSTOP of 7.4 s
                # was reported as changes 7.3 s late).
                continue
            late = self.outbox.overdue()
            if late > BUSY_HOLD + GUARD:
                self.stats.overdue_flushes += 1
                log.warning("index changes waited %.1f s past their time to leave (%s, "
                            "the sending loop %s); sent now", late, self.outbox.status(),
                            self._loop_at)
                self._flush()

    async def _changed(self, timeout: float) -> None:
        """Until entries are put, a batch completes or membership changes, or `timeout`."""
        with trio.move_on_after(timeout):
            async with trio.open_nursery() as nursery:
                async def until(wait: Callable[[], Awaitable[object]]) -> None:
                    await wait()
                    nursery.cancel_scope.cancel()

                nursery.start_soon(until, self.outbox.wait)
                nursery.start_soon(until, self._progress.wait)

    async def _carry(self) -> None:
        """A leader's gathered batches leave when due (grouped.LINGER): a later batch
        may put that off, an urgent one bring it forward (which wakes this)."""
        while True:
            await self._gathering.wait()
            self._gathering = trio.Event()
            while (at := self.tree.flush_at) is not None:
                wait = at - time.monotonic()
                if wait > 0:
                    self._carry_until = at
                    with trio.move_on_after(wait):
                        await self._gathering.wait()
                    self._carry_until = math.inf
                    self._gathering = trio.Event()
                    continue
                self._emit(self.tree.flush(time.monotonic()))
                self._notify()

    def _send(self, dst: str, msg: object, attempt: int = 0) -> None:
        """One message down or up a tree, not waited for: its call's outcome comes
        back to this trio thread (send_failed, acked_in_reply or delivered)."""
        token = trio.lowlevel.current_trio_token()

        def outcome(reply: pb.TreeReply | None, late: bool) -> None:  # in another thread
            if reply is None:
                then: Callable[[], None] = partial(self.send_failed, dst, msg,
                                                   failed_attempt(msg, late, attempt))
            elif reply.acked:
                then = partial(self.acked_in_reply, dst, msg)
            else:
                then = partial(self.delivered, dst, msg)

            def in_trio() -> None:
                # Not a task: an exception here would end the whole run (shutting down,
                # the broadcaster's nursery may be closed already).
                try:
                    then()
                except Exception as e:
                    log.debug("tree message to %s: %s", dst, e)

            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(in_trio)

        if self.calls.forward(dst, msg, outcome):
            self.tree.delivered(dst, msg)  # (on a stream: outcome tells only of a failure)

    def send_failed(self, dst: str, msg: object, attempt: int) -> None:
        """A call carrying `msg` failed (in the trio thread): send it again shortly,
        unless the host is no longer one of the trees'; a hand-over goes down this
        host's own tree at once."""
        self.stats.send_errors += 1
        if isinstance(msg, grouped.Carry):
            self._emit(self.tree.failed(dst, msg, time.monotonic()))
            self._notify()
        elif attempt < RESENDS:
            for nursery in self._nursery:  # (none before it runs)
                nursery.start_soon(self._resend, dst, msg, attempt + 1)

    async def _resend(self, dst: str, msg: object, attempt: int) -> None:
        await trio.sleep(RESEND * attempt)
        p = self.members.peers.get(dst)
        if p is None or not p.dead:
            self._send(dst, msg, attempt)

    async def _retry(self) -> None:
        while True:
            if not self.tree.busy() and not self._replies:
                # Nothing on its way: no timer to watch until a batch leaves or comes.
                await self._flying.wait()
            self._flying = trio.Event()
            await trio.sleep(TICK)
            self._emit(self.tree.tick(time.monotonic()))
            self._notify()  # (a batch whose leader told "carried" may complete in it)
            for key in [k for k, rs in self._replies.items() if all(r.abandoned for r in rs)]:
                del self._replies[key]  # their acks go as calls of their own

    async def _send_acks(self) -> None:
        while True:
            await self._acks_ready.wait()
            self._acks_ready = trio.Event()
            if self._unsettled:
                # Bounded: a notification can wait for a directory lock that a local
                # commit holds while it waits for the writer (see mtcfs.fs.kernel).
                self._unsettled = False
                await self._kernel_settled(KERNEL_SETTLE)
            acks, self._acks = self._acks, []
            for dst, msg in acks:
                self._send(dst, msg, 0)

    async def _kernel_settled(self, timeout: float) -> None:
        """Until the kernel dropped what it cached of the names applied so far, or
        `timeout` (no thread waits: the notifying thread wakes this one)."""
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()

        def settled() -> None:  # (in the notifying thread, or here)
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(done.set)

        self._kernel.when_settled(settled)
        with trio.move_on_after(timeout):
            await done.wait()

    def status(self) -> dict[str, object]:
        s = self.stats
        return {
            "commit_timeout": self.commit_timeout,
            "waits": s.waits,
            "wait_seconds": round(s.wait_seconds, 3),
            "max_wait_seconds": round(s.max_wait, 3),
            "timeouts": s.timeouts,
            "last_timeout": s.last_timeout or None,
            "broadcast_queue": self.pending(),
            "outbox": self.outbox.status(),
            "overdue_flushes": s.overdue_flushes,
        }

    def tree_status(self) -> dict[str, object]:
        return {**self.tree.status(), "hosts": len(self.counted()),
                "send_errors": self.stats.send_errors,
                "acks_in_replies": self.stats.acks_in_replies,
                "acks_received_in_replies": self.stats.acks_received_in_replies,
                "transport": self.calls.status()}
