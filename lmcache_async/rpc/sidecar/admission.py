"""Admission: which requests the sidecar takes on now, so that no client can starve the
others.

The control plane is never held: HELLO, PING, HEARTBEAT, STATS and HEALTH run whatever
the data plane's load. Every other request takes a slot of its peer (at most
``max_peer_requests`` in flight each) and of the server (``max_concurrency`` in all; MOVE,
which connects out, at most :data:`MAX_MOVES`); one that finds no slot is answered
``busy`` at once, from the socket's reader callback, instead of waiting, but for a COMMIT
or RELEASE, which gives memory back (:data:`ENDINGS`). So the socket is
always read, one peer's slow requests hold only its own slots, and the memory a flood can
hold is bounded by the slots. A peer is its CURVE key when it has one, else its ROUTER
identity.
"""

from __future__ import annotations

from typing import Final

from lmcache_async.rpc.protocol import MessageType

__all__ = ["CONTROL", "ENDINGS", "MAX_MOVES", "Admission"]

CONTROL: Final = frozenset(
    {
        MessageType.HELLO,
        MessageType.PING,
        MessageType.HEARTBEAT,
        MessageType.STATS,
        MessageType.HEALTH,
    }
)
"""Requests that take no slot: a client can always open, keep and inspect its session."""

ENDINGS: Final = frozenset({MessageType.COMMIT, MessageType.RELEASE})
"""Requests that end a transaction: taken even when their peer's or the server's slots
are full (they count in them), since a refused one would hold its memory until its
transaction's deadline, and a client need not wait for their reply."""

MAX_MOVES: Final = 4
"""MOVEs in flight at once: each opens a connection to another sidecar."""


class Admission:
    """Slots of the requests in flight, per peer and in all. For one thread (the loop)."""

    __slots__ = ("_by_peer", "_in_flight", "_moves", "_per_peer", "_total", "refused")

    def __init__(self, *, total: int, per_peer: int) -> None:
        self._total = total
        self._per_peer = per_peer
        self._in_flight = 0
        self._moves = 0
        self._by_peer: dict[bytes, int] = {}
        self.refused = 0
        """Requests answered ``busy``."""

    def admit(self, peer: bytes, kind: int) -> bool:
        """Take a slot for a ``kind`` request of ``peer``; False (counted): answer ``busy``.
        A control request always passes and takes nothing."""
        if kind in CONTROL:
            return True
        held = self._by_peer.get(peer, 0)
        moving = kind == MessageType.MOVE
        if kind not in ENDINGS and (
            held >= self._per_peer
            or self._in_flight >= self._total
            or (moving and self._moves >= MAX_MOVES)
        ):
            self.refused += 1
            return False
        self._by_peer[peer] = held + 1
        self._in_flight += 1
        self._moves += moving
        return True

    def done(self, peer: bytes, kind: int) -> None:
        """Give back the slot :meth:`admit` took for this request."""
        if kind in CONTROL:
            return
        held = self._by_peer.get(peer, 0) - 1
        if held > 0:
            self._by_peer[peer] = held
        else:
            self._by_peer.pop(peer, None)
        self._in_flight -= 1
        self._moves -= kind == MessageType.MOVE

    @property
    def in_flight(self) -> int:
        """Requests holding a slot now."""
        return self._in_flight
