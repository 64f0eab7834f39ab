"""The membership and dissemination cores' messages as protobuf (peer.proto's
GossipMessage and TreeMessage): what a gRPC transport sends, and what the
simulation counts as bytes on the wire."""

from __future__ import annotations

from mtcfs.peer import fanout, swim
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


def tree_to_pb(src: str, msg: fanout.Message) -> pb.TreeMessage:
    if isinstance(msg, fanout.Ack):
        return pb.TreeMessage(from_node=src, origin=msg.origin, seq=msg.seq, end=msg.end,
                              ack=True, start=msg.start)
    assert isinstance(msg.payload, pb.ChangeBatch)
    return pb.TreeMessage(from_node=src, origin=msg.origin, seq=msg.seq, end=msg.end,
                          batch=msg.payload)


def tree_from_pb(m: pb.TreeMessage) -> tuple[str, fanout.Message]:
    if m.ack:
        return m.from_node, fanout.Ack(m.origin, m.seq, m.start, m.end)
    return m.from_node, fanout.Forward(m.origin, m.seq, m.end, m.batch, m.batch.ByteSize())


def tree_size(src: str, msg: fanout.Message) -> int:
    """Bytes of the message on the wire, without encoding the batch again (its size
    was taken once, at publish)."""
    if isinstance(msg, fanout.Ack):
        return tree_to_pb(src, msg).ByteSize()
    head = pb.TreeMessage(from_node=src, origin=msg.origin, seq=msg.seq, end=msg.end)
    return head.ByteSize() + 1 + _varint_len(msg.size) + msg.size


def _varint_len(n: int) -> int:
    return max(1, (n.bit_length() + 6) // 7)
