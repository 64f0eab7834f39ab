"""The bulk data channel as one part of the peer tier: this host's connections to
peers' data channels (mtcfs.peer.bulk.BulkPool) and, once the tier runs, its own
server. `NoDataChannel` when it is off (--data-connections 0): file bytes then
move over gRPC only, and nothing asks whether a channel exists."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import trio

from mtcfs.peer.addresses import parse_address
from mtcfs.peer.bulk import BulkError, BulkPool, BulkServer, Conn
from mtcfs.peer.membership import Peer
from mtcfs.peer.server import PeerHandler

MakeServer = Callable[[PeerHandler, trio.lowlevel.TrioToken], BulkServer]


def data_address(p: Peer) -> tuple[str, int]:
    """A peer's data channel: the host of its --listen address, the port it said."""
    return parse_address(p.addr, "peer address")[0], p.data_port


class _NotListening:
    """The server before the tier started it."""

    def stop(self) -> None:
        pass

    def status(self) -> dict[str, int] | None:
        return None


class DataChannel:
    def __init__(self, pool: BulkPool, make_server: MakeServer) -> None:
        """`make_server(handler, token)`: this host's server, made at start (it calls
        into the trio thread)."""
        self.pool = pool
        self._make_server = make_server
        self._server: BulkServer | _NotListening = _NotListening()
        self.port = 0  # this host's data port once listening

    @property
    def connections(self) -> int:
        """Connections per peer (striped fetches and restores use them all)."""
        return self.pool.connections

    @property
    def encrypts(self) -> bool:
        """--peer-encryption: file bytes move only where they are encrypted."""
        return self.pool.keys.encrypt

    def reaches(self, p: Peer) -> bool:
        """File bytes to and from `p` can go over the channel (it offers one)."""
        return bool(p.data_port)

    def start(self, handler: PeerHandler, token: trio.lowlevel.TrioToken) -> int:
        server = self._make_server(handler, token)
        self.port = server.start()
        self._server = server
        return self.port

    def stop(self) -> None:
        self._server.stop()
        self.pool.close()

    def status(self) -> dict[str, int] | None:
        return self._server.status()

    # -- transfers (blocking: from worker threads) ----------------------------------------

    def push(self, p: Peer, *args: Any, **kwargs: Any) -> tuple[str, str, bool]:
        return self.pool.push(data_address(p), *args, **kwargs)

    def fetch(self, p: Peer, *args: Any) -> None:
        self.pool.fetch(data_address(p), *args)

    def fetch_chunk(self, p: Peer, *args: Any) -> bool:
        return self.pool.fetch_chunk(data_address(p), *args)

    def tree_stream(self, to: tuple[str, int]) -> Conn:
        """A connection that carries this host's tree messages to the data channel at
        `to` (Conn.tree_frame; blocking: from the stream's thread)."""
        return self.pool.tree_stream(to)


class NoDataChannel(DataChannel):
    """No data channel here: it reaches no peer, listens nowhere, moves nothing."""

    def __init__(self) -> None:
        self._server = _NotListening()
        self.port = 0

    @property
    def connections(self) -> int:
        return 0

    @property
    def encrypts(self) -> bool:
        return False

    def reaches(self, p: Peer) -> bool:
        return False

    def start(self, handler: PeerHandler, token: trio.lowlevel.TrioToken) -> int:
        return 0

    def stop(self) -> None:
        pass

    def push(self, p: Peer, *args: Any, **kwargs: Any) -> tuple[str, str, bool]:
        raise BulkError("no data channel here")

    def fetch(self, p: Peer, *args: Any) -> None:
        raise BulkError("no data channel here")

    def fetch_chunk(self, p: Peer, *args: Any) -> bool:
        raise BulkError("no data channel here")

    def tree_stream(self, to: tuple[str, int]) -> Conn:
        raise BulkError("no data channel here")
