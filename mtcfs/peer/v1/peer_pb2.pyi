from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GoneRequest(_message.Message):
    __slots__ = ("addresses", "reason")
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    addresses: _containers.RepeatedScalarFieldContainer[str]
    reason: str
    def __init__(self, addresses: _Optional[_Iterable[str]] = ..., reason: _Optional[str] = ...) -> None: ...

class GoneReply(_message.Message):
    __slots__ = ("probing",)
    PROBING_FIELD_NUMBER: _ClassVar[int]
    probing: int
    def __init__(self, probing: _Optional[int] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ("from_node", "lamport", "listen")
    FROM_NODE_FIELD_NUMBER: _ClassVar[int]
    LAMPORT_FIELD_NUMBER: _ClassVar[int]
    LISTEN_FIELD_NUMBER: _ClassVar[int]
    from_node: str
    lamport: int
    listen: str
    def __init__(self, from_node: _Optional[str] = ..., lamport: _Optional[int] = ..., listen: _Optional[str] = ...) -> None: ...

class HealthReply(_message.Message):
    __slots__ = ("node_id", "lamport", "failure_domain", "ram_capacity", "ram_free", "entries", "data_port")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LAMPORT_FIELD_NUMBER: _ClassVar[int]
    FAILURE_DOMAIN_FIELD_NUMBER: _ClassVar[int]
    RAM_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    RAM_FREE_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    lamport: int
    failure_domain: str
    ram_capacity: int
    ram_free: int
    entries: int
    data_port: int
    def __init__(self, node_id: _Optional[str] = ..., lamport: _Optional[int] = ..., failure_domain: _Optional[str] = ..., ram_capacity: _Optional[int] = ..., ram_free: _Optional[int] = ..., entries: _Optional[int] = ..., data_port: _Optional[int] = ...) -> None: ...

class Entry(_message.Message):
    __slots__ = ("id", "parent", "name", "mode", "uid", "gid", "mtime_ns", "ctime_ns", "size", "has_crc", "crc32c", "version", "holders", "target", "lamport", "writer", "removed", "block_size", "block_crcs", "persisted_version", "generation", "dropped", "rdev", "links", "author", "sources", "merged_ids")
    ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    GID_FIELD_NUMBER: _ClassVar[int]
    MTIME_NS_FIELD_NUMBER: _ClassVar[int]
    CTIME_NS_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    HAS_CRC_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    LAMPORT_FIELD_NUMBER: _ClassVar[int]
    WRITER_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_CRCS_FIELD_NUMBER: _ClassVar[int]
    PERSISTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    RDEV_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    AUTHOR_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    MERGED_IDS_FIELD_NUMBER: _ClassVar[int]
    id: str
    parent: str
    name: bytes
    mode: int
    uid: int
    gid: int
    mtime_ns: int
    ctime_ns: int
    size: int
    has_crc: bool
    crc32c: int
    version: int
    holders: _containers.RepeatedScalarFieldContainer[str]
    target: bytes
    lamport: int
    writer: str
    removed: bool
    block_size: int
    block_crcs: bytes
    persisted_version: int
    generation: int
    dropped: _containers.RepeatedScalarFieldContainer[str]
    rdev: int
    links: _containers.RepeatedCompositeFieldContainer[Link]
    author: str
    sources: _containers.RepeatedScalarFieldContainer[str]
    merged_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, id: _Optional[str] = ..., parent: _Optional[str] = ..., name: _Optional[bytes] = ..., mode: _Optional[int] = ..., uid: _Optional[int] = ..., gid: _Optional[int] = ..., mtime_ns: _Optional[int] = ..., ctime_ns: _Optional[int] = ..., size: _Optional[int] = ..., has_crc: _Optional[bool] = ..., crc32c: _Optional[int] = ..., version: _Optional[int] = ..., holders: _Optional[_Iterable[str]] = ..., target: _Optional[bytes] = ..., lamport: _Optional[int] = ..., writer: _Optional[str] = ..., removed: _Optional[bool] = ..., block_size: _Optional[int] = ..., block_crcs: _Optional[bytes] = ..., persisted_version: _Optional[int] = ..., generation: _Optional[int] = ..., dropped: _Optional[_Iterable[str]] = ..., rdev: _Optional[int] = ..., links: _Optional[_Iterable[_Union[Link, _Mapping]]] = ..., author: _Optional[str] = ..., sources: _Optional[_Iterable[str]] = ..., merged_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class Link(_message.Message):
    __slots__ = ("parent", "name")
    PARENT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    parent: str
    name: bytes
    def __init__(self, parent: _Optional[str] = ..., name: _Optional[bytes] = ...) -> None: ...

class ChangeBatch(_message.Message):
    __slots__ = ("from_node", "lamport", "entries", "caught_up", "coverage", "parts", "waited")
    FROM_NODE_FIELD_NUMBER: _ClassVar[int]
    LAMPORT_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    CAUGHT_UP_FIELD_NUMBER: _ClassVar[int]
    COVERAGE_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    WAITED_FIELD_NUMBER: _ClassVar[int]
    from_node: str
    lamport: int
    entries: _containers.RepeatedCompositeFieldContainer[Entry]
    caught_up: CaughtUp
    coverage: Coverage
    parts: _containers.RepeatedCompositeFieldContainer[Part]
    waited: bool
    def __init__(self, from_node: _Optional[str] = ..., lamport: _Optional[int] = ..., entries: _Optional[_Iterable[_Union[Entry, _Mapping]]] = ..., caught_up: _Optional[_Union[CaughtUp, _Mapping]] = ..., coverage: _Optional[_Union[Coverage, _Mapping]] = ..., parts: _Optional[_Iterable[_Union[Part, _Mapping]]] = ..., waited: _Optional[bool] = ...) -> None: ...

class Part(_message.Message):
    __slots__ = ("origin", "seq", "entries", "from_node", "lamport")
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    FROM_NODE_FIELD_NUMBER: _ClassVar[int]
    LAMPORT_FIELD_NUMBER: _ClassVar[int]
    origin: str
    seq: int
    entries: int
    from_node: str
    lamport: int
    def __init__(self, origin: _Optional[str] = ..., seq: _Optional[int] = ..., entries: _Optional[int] = ..., from_node: _Optional[str] = ..., lamport: _Optional[int] = ...) -> None: ...

class CaughtUp(_message.Message):
    __slots__ = ("hosts", "since_unix")
    HOSTS_FIELD_NUMBER: _ClassVar[int]
    SINCE_UNIX_FIELD_NUMBER: _ClassVar[int]
    hosts: _containers.RepeatedScalarFieldContainer[str]
    since_unix: float
    def __init__(self, hosts: _Optional[_Iterable[str]] = ..., since_unix: _Optional[float] = ...) -> None: ...

class Coverage(_message.Message):
    __slots__ = ("uncovered",)
    UNCOVERED_FIELD_NUMBER: _ClassVar[int]
    uncovered: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, uncovered: _Optional[_Iterable[str]] = ...) -> None: ...

class BatchReply(_message.Message):
    __slots__ = ("applied", "lamport")
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    LAMPORT_FIELD_NUMBER: _ClassVar[int]
    applied: int
    lamport: int
    def __init__(self, applied: _Optional[int] = ..., lamport: _Optional[int] = ...) -> None: ...

class SnapshotRequest(_message.Message):
    __slots__ = ("from_node", "listen", "since_s")
    FROM_NODE_FIELD_NUMBER: _ClassVar[int]
    LISTEN_FIELD_NUMBER: _ClassVar[int]
    SINCE_S_FIELD_NUMBER: _ClassVar[int]
    from_node: str
    listen: str
    since_s: float
    def __init__(self, from_node: _Optional[str] = ..., listen: _Optional[str] = ..., since_s: _Optional[float] = ...) -> None: ...

class PushHeader(_message.Message):
    __slots__ = ("entry", "path", "above")
    ENTRY_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    ABOVE_FIELD_NUMBER: _ClassVar[int]
    entry: Entry
    path: str
    above: _containers.RepeatedCompositeFieldContainer[Entry]
    def __init__(self, entry: _Optional[_Union[Entry, _Mapping]] = ..., path: _Optional[str] = ..., above: _Optional[_Iterable[_Union[Entry, _Mapping]]] = ...) -> None: ...

class PushChunk(_message.Message):
    __slots__ = ("header", "offset", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    offset: int
    data: bytes
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("stored", "node_id")
    STORED_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    stored: bool
    node_id: str
    def __init__(self, stored: _Optional[bool] = ..., node_id: _Optional[str] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("id", "version", "offset", "length", "path")
    ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    id: str
    version: int
    offset: int
    length: int
    path: str
    def __init__(self, id: _Optional[str] = ..., version: _Optional[int] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., path: _Optional[str] = ...) -> None: ...

class DataChunk(_message.Message):
    __slots__ = ("offset", "data")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class ListHeldRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HeldFile(_message.Message):
    __slots__ = ("id", "path", "version", "size", "crc32c")
    ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    id: str
    path: str
    version: int
    size: int
    crc32c: int
    def __init__(self, id: _Optional[str] = ..., path: _Optional[str] = ..., version: _Optional[int] = ..., size: _Optional[int] = ..., crc32c: _Optional[int] = ...) -> None: ...

class ListHeldReply(_message.Message):
    __slots__ = ("node_id", "files")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    files: _containers.RepeatedCompositeFieldContainer[HeldFile]
    def __init__(self, node_id: _Optional[str] = ..., files: _Optional[_Iterable[_Union[HeldFile, _Mapping]]] = ...) -> None: ...

class MemberUpdate(_message.Message):
    __slots__ = ("node", "state", "incarnation", "node_id", "failure_domain", "data_port")
    NODE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    FAILURE_DOMAIN_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    node: str
    state: int
    incarnation: int
    node_id: str
    failure_domain: str
    data_port: int
    def __init__(self, node: _Optional[str] = ..., state: _Optional[int] = ..., incarnation: _Optional[int] = ..., node_id: _Optional[str] = ..., failure_domain: _Optional[str] = ..., data_port: _Optional[int] = ...) -> None: ...

class GossipMessage(_message.Message):
    __slots__ = ("from_node", "kind", "seq", "incarnation", "target", "updates", "node_id", "failure_domain", "data_port", "ram_free", "ready", "to", "stamp")
    FROM_NODE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    FAILURE_DOMAIN_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    RAM_FREE_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    TO_FIELD_NUMBER: _ClassVar[int]
    STAMP_FIELD_NUMBER: _ClassVar[int]
    from_node: str
    kind: int
    seq: int
    incarnation: int
    target: str
    updates: _containers.RepeatedCompositeFieldContainer[MemberUpdate]
    node_id: str
    failure_domain: str
    data_port: int
    ram_free: int
    ready: bool
    to: str
    stamp: int
    def __init__(self, from_node: _Optional[str] = ..., kind: _Optional[int] = ..., seq: _Optional[int] = ..., incarnation: _Optional[int] = ..., target: _Optional[str] = ..., updates: _Optional[_Iterable[_Union[MemberUpdate, _Mapping]]] = ..., node_id: _Optional[str] = ..., failure_domain: _Optional[str] = ..., data_port: _Optional[int] = ..., ram_free: _Optional[int] = ..., ready: _Optional[bool] = ..., to: _Optional[str] = ..., stamp: _Optional[int] = ...) -> None: ...

class TreeMessage(_message.Message):
    __slots__ = ("from_node", "origin", "seq", "end", "ack", "start", "batch", "carry", "carried", "held")
    FROM_NODE_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    CARRY_FIELD_NUMBER: _ClassVar[int]
    CARRIED_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    from_node: str
    origin: str
    seq: int
    end: str
    ack: bool
    start: str
    batch: ChangeBatch
    carry: bool
    carried: _containers.RepeatedScalarFieldContainer[int]
    held: bool
    def __init__(self, from_node: _Optional[str] = ..., origin: _Optional[str] = ..., seq: _Optional[int] = ..., end: _Optional[str] = ..., ack: _Optional[bool] = ..., start: _Optional[str] = ..., batch: _Optional[_Union[ChangeBatch, _Mapping]] = ..., carry: _Optional[bool] = ..., carried: _Optional[_Iterable[int]] = ..., held: _Optional[bool] = ...) -> None: ...

class OneWay(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TreeReply(_message.Message):
    __slots__ = ("acked",)
    ACKED_FIELD_NUMBER: _ClassVar[int]
    acked: bool
    def __init__(self, acked: _Optional[bool] = ...) -> None: ...
