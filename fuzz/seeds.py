"""The seed corpus (fuzz/corpus/<target>/): small valid messages of each kind,
made from the protocol's own types. `python -m fuzz.seeds` writes it again.

Addresses in seeds are placeholders of the length of a loopback address with an
ephemeral port (PEER, HOST); the targets put the running host's in their place."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import struct
import sys

from fuzz.host import NODE_ID, PEER_NODE, SEED_FILES, START_LAMPORT, file_entry
from mtcfs.core.namespace import ROOT_GUID
from mtcfs.peer import gossip, swim
from mtcfs.peer.v1 import peer_pb2 as pb

PEER = "127.0.0.1:PEERP"  # the configured peer (its datagrams reach SWIM)
HOST = "127.0.0.1:HOSTP"  # the daemon under test
CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")
SMALL = next(iter(SEED_FILES))
NEW = b"new file bytes\n" * 10


def _lamport(n: int) -> int:
    return START_LAMPORT + 10 + n


def batches() -> list[pb.ChangeBatch]:
    d2 = "d0000000000000000000000000000002"
    new = file_entry("f0000000000000000000000000000009", b"new", NEW)
    new.lamport = _lamport(1)
    renamed = file_entry(SMALL, b"renamed", SEED_FILES[SMALL][1])
    renamed.lamport = _lamport(2)
    linked = file_entry(SMALL, b"small", SEED_FILES[SMALL][1])
    linked.lamport = _lamport(3)
    linked.links.append(pb.Link(parent=d2, name=b"hardlink"))
    holders = file_entry(SMALL, b"small", SEED_FILES[SMALL][1])
    holders.holders.append(NODE_ID)
    holders.dropped.append(PEER_NODE)
    return [
        pb.ChangeBatch(from_node=PEER_NODE, lamport=_lamport(0), entries=[
            pb.Entry(id=d2, parent=ROOT_GUID, name=b"step_2", mode=0o40755,
                     lamport=_lamport(0), writer=PEER_NODE),
            new,
            pb.Entry(id="s0000000000000000000000000000001", parent=d2, name=b"link",
                     mode=0o120777, target=b"../step_1/small", lamport=_lamport(0),
                     writer=PEER_NODE)]),
        pb.ChangeBatch(from_node=PEER_NODE, entries=[renamed]),
        pb.ChangeBatch(from_node=PEER_NODE, entries=[linked]),
        pb.ChangeBatch(from_node=PEER_NODE, entries=[holders]),
        # The step made under another id, renamed, naming d2 as its other id: the
        # receiver folds its d2 into it.
        pb.ChangeBatch(from_node=PEER_NODE, entries=[
            pb.Entry(id="d0000000000000000000000000000003", parent=ROOT_GUID,
                     name=b"step_2.mtcfs-withdrawn", mode=0o40755, lamport=_lamport(4),
                     writer=PEER_NODE, merged_ids=[d2])]),
        pb.ChangeBatch(from_node=PEER_NODE, entries=[
            pb.Entry(id=SMALL, lamport=_lamport(9), writer=PEER_NODE, removed=True)]),
        pb.ChangeBatch(from_node=PEER_NODE, caught_up=pb.CaughtUp(hosts=[PEER],
                                                                  since_unix=1.7e9),
                       coverage=pb.Coverage(uncovered=[PEER])),
    ]


def trees() -> list[pb.TreeMessage]:
    out = [pb.TreeMessage(from_node=PEER, origin=PEER, seq=i + 1, end=HOST, batch=b)
           for i, b in enumerate(batches()[:2])]
    out.append(pb.TreeMessage(from_node=PEER, origin=HOST, seq=1, ack=True, start=HOST,
                              end=PEER))
    # A leader's bundle of two writers' batches, a hand-over, and its answers.
    first, second = batches()[:2]
    bundle = pb.ChangeBatch(from_node=PEER_NODE, entries=[*first.entries, *second.entries],
                            parts=[pb.Part(origin=PEER, seq=7, entries=len(first.entries),
                                           from_node=PEER_NODE),
                                   pb.Part(origin="127.0.0.1:9", seq=3, entries=len(second.entries),
                                           from_node=PEER_NODE)])
    out.append(pb.TreeMessage(from_node=PEER, origin=PEER, seq=3, end=HOST, batch=bundle))
    out.append(pb.TreeMessage(from_node=PEER, origin=PEER, seq=8, carry=True, batch=first))
    out.append(pb.TreeMessage(from_node=PEER, origin=PEER, seq=1, carried=[1, 2]))
    out.append(pb.TreeMessage(from_node=PEER, origin=PEER, seq=1, carried=[1], held=True))
    return out


def push_chunks() -> list[list[pb.PushChunk]]:
    new = file_entry("f0000000000000000000000000000008", b"pushed", NEW)
    v2 = file_entry(SMALL, b"small", NEW)
    v2.version, v2.lamport = 2, _lamport(5)
    return [[pb.PushChunk(header=pb.PushHeader(entry=new, path="step_1/pushed")),
             pb.PushChunk(offset=0, data=NEW[:64]), pb.PushChunk(offset=64, data=NEW[64:])],
            [pb.PushChunk(header=pb.PushHeader(entry=v2, path="step_1/small"), data=NEW)]]


def records(messages: list[bytes]) -> bytes:
    return b"".join(struct.pack("<H", len(m)) + m for m in messages)


def grpc_requests() -> list[tuple[int, bytes]]:
    """(method index in fuzz.targets.METHODS, request bytes)."""
    out: list[tuple[int, bytes]] = [
        (0, pb.HealthRequest(from_node=PEER_NODE, lamport=3, listen=PEER).SerializeToString())]
    out += [(1, b.SerializeToString()) for b in batches()]
    out += [(2, t.SerializeToString()) for t in trees()]
    out += [(3, pb.SnapshotRequest(from_node=PEER_NODE, listen=PEER,
                                   since_s=s).SerializeToString()) for s in (0.0, 60.0)]
    out += [(4, records([c.SerializeToString() for c in p])) for p in push_chunks()]
    out += [(5, pb.FetchRequest(id=g, version=1, offset=o, length=n,
                                path="step_1/x").SerializeToString())
            for g, o, n in ((SMALL, 0, 0), (list(SEED_FILES)[1], 100, 50))]
    out += [(6, b""), (7, gossip_messages()[0].SerializeToString())]
    out += [(8, pb.GoneRequest(addresses=[PEER, "10.0.0.9:7000"],
                               reason="pod deleted").SerializeToString())]
    return out


def gossip_messages() -> list[pb.GossipMessage]:
    me = pb.MemberUpdate(node=HOST, state=swim.SUSPECT, incarnation=1)
    them = pb.MemberUpdate(node=PEER, state=swim.ALIVE, incarnation=5, node_id=PEER_NODE,
                           data_port=9)
    base = {"from_node": PEER, "node_id": PEER_NODE, "incarnation": 5, "ready": True}
    return [pb.GossipMessage(kind=swim.PING, seq=1, **base),
            pb.GossipMessage(kind=swim.ACK, seq=1, target=HOST, **base),
            pb.GossipMessage(kind=swim.PING_REQ, seq=2, target=PEER, **base),
            pb.GossipMessage(kind=swim.GOSSIP, updates=[me, them], **base),
            pb.GossipMessage(kind=swim.SYNC, updates=[them], **base),
            pb.GossipMessage(kind=swim.SYNC_REPLY, updates=[me, them], **base),
            pb.GossipMessage(kind=swim.GOSSIP, updates=[
                pb.MemberUpdate(node=HOST, state=swim.DEAD, incarnation=2**40)], **base)]


def bulk_inputs() -> list[bytes]:
    def control(msg: dict[str, object]) -> bytes:
        body = json.dumps(msg).encode()
        return bytes([0]) + struct.pack("<I", len(body)) + body

    def block(offset: int, data: bytes) -> bytes:
        body = struct.pack("<Q", offset) + data
        return bytes([1]) + struct.pack("<I", len(body)) + body

    e = file_entry("f0000000000000000000000000000007", b"bulk", NEW)
    entry = base64.b64encode(e.SerializeToString()).decode()
    small = SEED_FILES[SMALL][1]
    return [
        b"\0" + control({"op": "push", "path": "step_1/bulk", "entry": entry})
        + block(0, NEW) + control({"op": "end"}),
        b"\0" + control({"op": "fetch", "id": SMALL, "version": 1, "path": "step_1/small",
                         "offset": 0, "length": 0}),
        b"\0" + control({"op": "chunk", "id": SMALL, "version": 1, "offset": 0,
                         "length": len(small), "wait": False}),
        b"\0" + control({"op": "push", "entry": entry}) + block(4096, NEW),
        b"\0" + control({"op": "what"}),
        b"\0" + control({"op": "tree"}) + b"".join(
            bytes([3]) + struct.pack("<I", len(t)) + t
            for t in (m.SerializeToString() for m in trees())),
        b"\1" + b"\0" + bytes(32) + bytes(32),
        b"\2" + struct.pack("<cQI16s", b"C", 0, 2, bytes(16)) + b"{}",
    ]


def corpus() -> dict[str, list[bytes]]:
    grpc = [bytes([m]) + r for m, r in grpc_requests()]
    token = (b"\x00" * 0 + bytes([len(b"fuzz-token-0123456789abcdef")])
             + b"fuzz-token-0123456789abcdef")
    grpc_token = [bytes([m]) + token + r for m, r in grpc_requests()]
    grpc_token += [bytes([m, 5]) + b"wrong" + r for m, r in grpc_requests()[:8]]
    grpc_token += [bytes([1, 0]) + batches()[0].SerializeToString()]
    index = [b"\0" + b.SerializeToString() for b in batches()]
    index += [b"\1" + t.SerializeToString() for t in trees()]
    gossips = [b"\0" + m.SerializeToString() for m in gossip_messages()]
    m = gossip_messages()[0]
    m.to, m.stamp = HOST, 1
    gossips += [b"\1" + m.SerializeToString(), b"\2" + gossip.MAGIC + bytes(40)]
    return {"grpc": grpc, "grpc-token": grpc_token, "index": index, "gossip": gossips,
            "bulk": bulk_inputs(), "bulk-encrypted": bulk_inputs()}


def write(root: str = CORPUS) -> int:
    n = 0
    for target, inputs in corpus().items():
        d = os.path.join(root, target)
        os.makedirs(d, exist_ok=True)
        for data in inputs:
            with open(os.path.join(d, "seed-" + hashlib.sha1(data).hexdigest()[:16]), "wb") as f:
                f.write(data)
            n += 1
    return n


if __name__ == "__main__":
    print(f"{write(sys.argv[1] if len(sys.argv) > 1 else CORPUS)} seeds written")
