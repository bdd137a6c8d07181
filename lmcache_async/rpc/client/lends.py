"""What pinned lookups lent: a client that maps the sidecar's segment asks a pinned lookup
by digests to lend its hit (``"lend": true``), and the reply names the pinned chunks'
offsets in a transaction. The retrieve that follows under the same lookup id copies out
of them with no RETRIEVE round trip and ends the transaction with a RELEASE it does not
wait for; a retrieve that cannot use them (other tokens, another tenant, tiers named, the
lend about to expire, a reconnected link) lets them go and asks the sidecar as before.

A retrieve served from a lend loads the hit the lookup found (chunks stored since are
left to a later retrieve). A lend is used once, and only before its pins expire on the
server; the server holds its payloads longer by twice the client's timeout (which the
lookup says), so a copy begun in time ends before they can be reused.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, Final

import anyio

from lmcache_async.rpc.client.link import Link
from lmcache_async.rpc.protocol import Message, MessageType

__all__ = ["Lend", "Lends"]

_KEPT: Final = 4096
"""Lends remembered at most (more than a serving engine has requests in flight); the
oldest past it are given back."""


@dataclass(slots=True)
class Lend:
    """One pinned lookup's lent chunks (``[start, end, offset, nbytes]`` as the reply has
    them, checked when used), its transaction on ``link``, the lookup's joined chunk
    digests, its tenant and when it stops being usable (the loop's clock)."""

    link: Link
    txn: int
    chunks: list[Any]
    digests: bytes
    tenant: str | None
    usable_until: float


class Lends:
    """The lends of one client's pinned lookups, by lookup id; ``timeout`` is the
    client's per-request timeout."""

    def __init__(self, timeout: float) -> None:
        self._timeout = timeout
        self._by_id: collections.OrderedDict[Hashable, Lend] = collections.OrderedDict()

    def keep(
        self,
        link: Link,
        lookup_id: Hashable,
        reply: Message,
        digests: bytes,
        tenant: str | None,
    ) -> None:
        """Remember the lend of a pinned lookup's ``reply`` (if it has one); a lend it
        replaces (the same id pinned again: the server dropped its pins) is given back."""
        header = reply.header
        txn, chunks, ttl = header.get("txn"), header.get("chunks"), header.get("ttl")
        old = self._by_id.pop(lookup_id, None)
        if old is not None:
            self.release(old)
        if not isinstance(txn, int) or isinstance(txn, bool):
            return
        if not isinstance(chunks, list) or not chunks or not isinstance(ttl, int | float):
            self.release(Lend(link, txn, [], b"", None, 0.0))
            return
        until = anyio.current_time() + float(ttl)
        self._by_id[lookup_id] = Lend(link, txn, chunks, digests, tenant, until)
        while len(self._by_id) > _KEPT:
            _, oldest = self._by_id.popitem(last=False)
            self.release(oldest)

    def take(self, lookup_id: Hashable) -> Lend | None:
        """The lend of ``lookup_id``, no longer remembered (the caller ends it)."""
        return self._by_id.pop(lookup_id, None)

    def release(
        self, lend: Lend, *, loaded: int = 0, retrieve: bool = False, unpin: bool = False
    ) -> None:
        """End ``lend``'s transaction (sent on the loop's next pass, not waited for, ahead
        of the link's next message): ``retrieve``, a load of ``loaded``
        tokens served from it (the server counts it and drops the lookup's pins);
        ``unpin``, the pins dropped too; neither, the pins kept for a RETRIEVE."""
        header: dict[str, Any] = {"txn": lend.txn, "loaded": loaded}
        if retrieve:
            header["retrieve"] = True
        elif unpin:
            header["unpin"] = True
        lend.link.notify_soon(MessageType.RELEASE, header, self._timeout)

    def release_all(self) -> None:
        """Give every lend back (the client closes)."""
        while self._by_id:
            _, lend = self._by_id.popitem(last=False)
            self.release(lend)
