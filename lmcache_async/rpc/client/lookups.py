"""A client's lookups: LOOKUP (a promise too), PREFETCH and UNPIN.

With the server's key hasher (from its welcome) a lookup by tokens sends the prompt's
chunk digests (32 bytes a chunk), not the tokens: the server neither converts nor hashes
the prompt. A prompt the hasher remembers is sent on a guess, its tokens compared with the
remembered ones while the request is in flight.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Hashable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Final

from lmcache_async.engine.client import Promise
from lmcache_async.errors import ProtocolError
from lmcache_async.keys.chunks import ChunkHasher, DigestGuess
from lmcache_async.keys.tokens import Tokens
from lmcache_async.logging import get_logger
from lmcache_async.rpc.client.connection import Connection
from lmcache_async.rpc.client.lends import Lends
from lmcache_async.rpc.client.welcome import check_tiers
from lmcache_async.rpc.client.wire import (
    Unavailable,
    check_lookup_id,
    chunk_digests,
    count,
    key_fields,
)
from lmcache_async.rpc.protocol import MessageType, put_tenant

if TYPE_CHECKING:
    from lmcache_async.rpc.client.stores import Stores

__all__ = ["Lookups"]

log = get_logger(__name__)

_EMPTY_IDS: Final = 4096
"""Lookup ids remembered as holding no pins: more than a serving engine has requests in
flight."""


class Lookups:
    """The lookup requests over ``conn``; what pinned lookups lend is kept in ``lends``."""

    def __init__(self, conn: Connection, lends: Lends) -> None:
        self._conn = conn
        self._lends = lends
        # Lookup ids whose pinned lookup the sidecar answered with no hit: it holds nothing
        # under them, so their UNPIN is not sent (a round trip saved on every miss).
        self._empty: collections.OrderedDict[int | str, None] = collections.OrderedDict()

    async def by_digests(
        self,
        hasher: ChunkHasher,
        tokens: Tokens,
        options: dict[str, Any],
        tenant: str | None,
        stores: Stores | None,
    ) -> int:
        """A LOOKUP by the prompt's chunk digests (of the tenant's keys): 32 bytes a chunk
        on the wire, and the server neither converts nor hashes the prompt; sent on the
        memo's guess when it has one. With ``stores`` (a pinned lookup of a client with
        ``store_ahead``) the prompt's STORE is sent right behind it."""
        guess = hasher.guess(tokens)
        if guess is not None:
            joined = b"".join(guess.digests)
            ahead = None if stores is None else partial(stores.send_ahead, tokens, joined, tenant)
            hits = await self.guessed(guess, options, also=ahead)
            if hits is not None:
                return hits
            if stores is not None:
                stores.forget_ahead(joined, tenant)
        joined = b"".join(await chunk_digests(hasher, tokens))
        ahead = None if stores is None else partial(stores.send_ahead, tokens, joined, tenant)
        header = {"digests_of": len(tokens), **options}
        found = await self.hits(MessageType.LOOKUP, header, [joined], len(tokens), meanwhile=ahead)
        return found or 0

    async def guessed(
        self,
        guess: DigestGuess,
        options: dict[str, Any],
        *,
        also: Callable[[], object] | None = None,
    ) -> int | None:
        """A lookup sent with the digests the memo guesses for the prompt, its tokens
        compared with the remembered ones while the request is in flight: off the round
        trip, which would otherwise wait for reading the whole prompt twice. The hits,
        0 when the sidecar cannot be reached, or None when the guess was wrong (the
        tokens changed in place): then the caller asks again with the right digests,
        and its pins replace any this lookup made. ``also`` runs once the request is sent,
        before the comparison."""
        confirmed = False

        def confirm() -> None:
            nonlocal confirmed
            if also is not None:
                also()
            confirmed = guess.confirm()

        header = {"digests_of": guess.num_tokens, **options}
        payloads = [b"".join(guess.digests)]
        hits = await self.hits(
            MessageType.LOOKUP, header, payloads, guess.num_tokens, meanwhile=confirm
        )
        if hits is None:
            return 0  # a miss, whatever the tokens are
        return hits if confirmed else None

    async def hits(
        self,
        msg_type: MessageType,
        header: dict[str, Any],
        payloads: Sequence[object],
        num_tokens: int,
        *,
        meanwhile: Callable[[], object] | None = None,
    ) -> int | None:
        """The ``hits`` a LOOKUP or PREFETCH answers, 0 for no tokens; None when the
        sidecar cannot be reached (logged at debug). ``meanwhile`` runs once the request
        is sent, before its reply is awaited."""
        conn = self._conn
        link = await conn.usable()
        if link is None:
            return None
        if num_tokens == 0:
            return 0
        pinned = msg_type is MessageType.LOOKUP and header.get("pin") is True
        if pinned and link.segment is not None and "digests_of" in header:
            header["lend"] = True  # the hit's offsets, for the retrieve that follows
            header["timeout"] = conn.timeout
        try:
            reply = await conn.ask(link, msg_type, header, payloads, meanwhile=meanwhile)
            hits = count(reply, "hits")
        except (Unavailable, ProtocolError) as exc:
            log.debug("sidecar_request_missed", type=msg_type.name, error=str(exc))
            return None
        if pinned:
            self._note_pins(header["lookup_id"], hits)
            if header.get("lend"):
                digests = payloads[0] if payloads and isinstance(payloads[0], bytes) else b""
                self._lends.keep(link, header["lookup_id"], reply, digests, header.get("tenant"))
        return hits

    def _note_pins(self, lookup_id: int | str, hits: int) -> None:
        """Remember whether the sidecar holds pins under ``lookup_id`` after a pinned
        lookup that found ``hits`` tokens (the last :data:`_EMPTY_IDS` ids that hold none)."""
        empty = self._empty
        if hits:
            empty.pop(lookup_id, None)
            return
        empty[lookup_id] = None
        empty.move_to_end(lookup_id)
        if len(empty) > _EMPTY_IDS:
            empty.popitem(last=False)  # forgotten: its UNPIN is sent, which is harmless

    async def prefetch(
        self,
        tokens: Tokens | None,
        *,
        lookup_id: Hashable,
        hashes: Sequence[int | bytes] | None,
        offsets: Sequence[int] | None,
        search_range: Sequence[str] | None,
        tenant: str | None = None,
    ) -> int:
        """As :meth:`RemoteCacheEngine.prefetch`.

        Raises:
            InvalidInputError: bad input.
            EngineClosedError: the client is closed.
        """
        self._conn.check_open()
        header, payloads, num_tokens = key_fields(tokens, hashes, offsets)
        header["lookup_id"] = check_lookup_id(lookup_id)
        locations = check_tiers(self._conn.welcome, search_range, "search_range")
        if locations is not None:
            header["search_range"] = locations
        put_tenant(header, tenant)
        return await self.hits(MessageType.PREFETCH, header, payloads, num_tokens) or 0

    async def promise(
        self,
        tokens: Tokens | None,
        *,
        lookup_id: Hashable,
        hashes: Sequence[int | bytes] | None,
        offsets: Sequence[int] | None,
        tenant: str | None,
        options: dict[str, Any],
    ) -> Promise:
        """As :meth:`RemoteCacheEngine.promise`: a LOOKUP with ``"promise": true`` and the
        promise's ``options`` (``computed``, ``prefill_tps``, ``finish``); nothing promised
        when the sidecar cannot be reached.

        Raises:
            InvalidInputError: bad input.
            EngineClosedError: the client is closed.
        """
        conn = self._conn
        conn.check_open()
        header, payloads, num_tokens = key_fields(tokens, hashes, offsets)
        header.update(options, promise=True, lookup_id=check_lookup_id(lookup_id))
        put_tenant(header, tenant)
        link = await conn.usable()
        if link is None or num_tokens == 0:
            return Promise(0, False)
        try:
            reply = await conn.ask(link, MessageType.LOOKUP, header, payloads)
            return Promise(count(reply, "hits"), reply.header.get("pending") is True)
        except (Unavailable, ProtocolError) as exc:
            log.debug("sidecar_request_missed", type="PROMISE", error=str(exc))
            return Promise(0, False)

    async def unpin(self, lookup_id: Hashable) -> None:
        """As :meth:`RemoteCacheEngine.lookup_unpin`."""
        conn = self._conn
        conn.check_open()
        checked = check_lookup_id(lookup_id)
        if self._empty.pop(checked, False) is None:
            return  # its lookup pinned nothing
        lend = self._lends.take(checked)
        if lend is not None:  # its RELEASE drops the pins too: no UNPIN round trip
            self._lends.release(lend, unpin=True)
            return
        header = {"lookup_id": checked}
        link = await conn.usable()
        if link is None:
            return
        try:
            await conn.ask(link, MessageType.UNPIN, header)
        except (Unavailable, ProtocolError):
            return
