"""The membership and dissemination cores' messages as protobuf (peer.proto's
GossipMessage and TreeMessage): what a gRPC transport sends, and what the
simulation counts as bytes on the wire."""

from __future__ import annotations

from mtcfs.peer import fanout, grouped, swim
from mtcfs.peer.v1 import peer_pb2 as pb


def gossip_to_pb(src: str, msg: swim.Message) -> pb.GossipMessage:
    return pb.GossipMessage(
        from_node=src, kind=msg.kind, seq=msg.seq, incarnation=msg.incarnation,
        target=msg.target,
        updates=[pb.MemberUpdate(node=u.node, state=u.state, incarnation=u.incarnation)
                 for u in msg.updates])


def gossip_from_pb(m: pb.GossipMessage) -> tuple[str, swim.Message]:
    updates = tuple(swim.Update(u.node, u.state, u.incarnation) for u in m.updates)
    return m.from_node, swim.Message(m.kind, m.seq, m.incarnation, m.target, updates)


def tree_to_pb(src: str, msg: object) -> pb.TreeMessage:
    if isinstance(msg, fanout.Ack):
        return pb.TreeMessage(from_node=src, origin=msg.origin, seq=msg.seq, end=msg.end,
                              ack=True, start=msg.start)
    if isinstance(msg, grouped.Carry):
        return pb.TreeMessage(from_node=src, origin=msg.part.origin, seq=msg.part.seq,
                              carry=True, batch=msg.part.payload)
    if isinstance(msg, grouped.Carried):
        return pb.TreeMessage(from_node=src, origin=src, seq=msg.seqs[0],
                              carried=msg.seqs, held=msg.held)
    assert isinstance(msg, fanout.Forward)
    batch = msg.payload
    if isinstance(batch, grouped.Bundle):
        batch = bundle_to_pb(batch)
    return pb.TreeMessage(from_node=src, origin=msg.origin, seq=msg.seq, end=msg.end,
                          batch=batch)


def tree_from_pb(m: pb.TreeMessage) -> tuple[str, object]:
    if m.ack:
        return m.from_node, fanout.Ack(m.origin, m.seq, m.start, m.end)
    if m.carry:
        return m.from_node, grouped.Carry(grouped.Part(m.origin, m.seq, m.batch,
                                                       m.batch.ByteSize(), m.batch.waited))
    if m.carried:
        return m.from_node, grouped.Carried(tuple(m.carried), m.held)
    size = m.batch.ByteSize()
    return m.from_node, fanout.Forward(m.origin, m.seq, m.end,
                                       bundle_from_pb(m.origin, m.seq, m.batch, size), size)


def bundle_to_pb(bundle: grouped.Bundle) -> pb.ChangeBatch:
    """One batch on the wire: the parts' entries one after the other (made once)."""
    if bundle.encoded is None:
        batches = [p.payload for p in bundle.parts]
        assert all(isinstance(b, pb.ChangeBatch) for b in batches)
        first = batches[0]
        out = pb.ChangeBatch(from_node=first.from_node,
                             lamport=max(b.lamport for b in batches))
        if len(batches) == 1:
            out.CopyFrom(first)
        else:
            for b in batches:
                out.entries.extend(b.entries)
        out.parts.extend(pb.Part(origin=p.origin, seq=p.seq, entries=len(b.entries),
                                 from_node=b.from_node, lamport=b.lamport)
                         for p, b in zip(bundle.parts, batches, strict=True))
        bundle.encoded = out
    assert isinstance(bundle.encoded, pb.ChangeBatch)
    return bundle.encoded


def bundle_from_pb(origin: str, seq: int, batch: pb.ChangeBatch,
                   size: int) -> grouped.Bundle:
    """A tree's batch as its writers' parts (a batch without parts: one writer's, the
    tree's; a peer's entries counts that do not add up: BadBatch)."""
    if len(batch.parts) <= 1:
        p = batch.parts[0] if batch.parts else pb.Part(origin=origin, seq=seq)
        return grouped.Bundle((grouped.Part(p.origin, p.seq, batch, size),), encoded=batch)
    if sum(p.entries for p in batch.parts) != len(batch.entries):
        raise BadBundle("a bundle's parts do not add up to its entries")
    parts, at = [], 0
    for p in batch.parts:
        one = pb.ChangeBatch(from_node=p.from_node, lamport=p.lamport,
                             entries=batch.entries[at:at + p.entries])
        at += p.entries
        parts.append(grouped.Part(p.origin, p.seq, one, one.ByteSize()))
    return grouped.Bundle(tuple(parts), encoded=batch)


class BadBundle(ValueError):
    pass


def tree_size(src: str, msg: object) -> int:
    """Bytes of the message on the wire, without encoding the batch again (its size
    was taken once, at publish)."""
    if isinstance(msg, fanout.Forward):
        head = pb.TreeMessage(from_node=src, origin=msg.origin, seq=msg.seq, end=msg.end)
        size = msg.size
        if isinstance(msg.payload, grouped.Bundle):  # (encoded and sized once per bundle)
            if msg.payload.encoded_size < 0:
                msg.payload.encoded_size = bundle_to_pb(msg.payload).ByteSize()
            size = msg.payload.encoded_size
        return head.ByteSize() + 1 + _varint_len(size) + size
    if isinstance(msg, grouped.Carry):
        head = pb.TreeMessage(from_node=src, origin=msg.part.origin, seq=msg.part.seq,
                              carry=True)
        return head.ByteSize() + 1 + _varint_len(msg.part.size) + msg.part.size
    return tree_to_pb(src, msg).ByteSize()


def _varint_len(n: int) -> int:
    return max(1, (n.bit_length() + 6) // 7)
