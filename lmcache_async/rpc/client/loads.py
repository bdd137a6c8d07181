"""A client's retrieves: RETRIEVE (in parts for a long load), the copies out of the chunks
the sidecar lends, then RELEASE, not waited for. A retrieve under a pinned lookup's id
copies out of what the lookup lent (:mod:`~.lends`) with no RETRIEVE, when it can.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from typing import Any

import anyio
import torch

from lmcache_async.core.copy import mark_loaded
from lmcache_async.errors import ProtocolError
from lmcache_async.keys import DIGEST_SIZE
from lmcache_async.keys.tokens import Tokens, is_strict_int
from lmcache_async.logging import get_logger
from lmcache_async.rpc.client.connection import Connection
from lmcache_async.rpc.client.copies import Chunk, CopyPath, Prepared
from lmcache_async.rpc.client.lends import Lend, Lends
from lmcache_async.rpc.client.link import Link, Sent
from lmcache_async.rpc.client.welcome import check_tiers
from lmcache_async.rpc.client.wire import Unavailable, check_lookup_id, chunk_digests
from lmcache_async.rpc.protocol import Message, MessageType

__all__ = ["Loads"]

log = get_logger(__name__)


class Loads:
    """Retrieves over ``conn``, copied by ``copies``; what pinned lookups lent is in
    ``lends``."""

    def __init__(self, conn: Connection, copies: CopyPath, lends: Lends) -> None:
        self._conn = conn
        self._copies = copies
        self._lends = lends

    async def retrieve(
        self,
        tokens: Tokens | None,
        *,
        kv_caches: Sequence[torch.Tensor],
        slot_mapping: torch.Tensor,
        mask: torch.Tensor | None,
        req_id: str | None,
        lookup_id: Hashable | None,
        hashes: Sequence[int | bytes] | None,
        offsets: Sequence[int] | None,
        retrieve_locations: Sequence[str] | None,
        stream: torch.cuda.Stream | None = None,
        tenant: str | None = None,
    ) -> torch.Tensor:
        """As :meth:`RemoteCacheEngine.retrieve`.

        Raises:
            InvalidInputError: bad input.
            EngineClosedError: the client is closed.
        """
        conn = self._conn
        conn.check_open()
        prepared = self._copies.prepare(
            tokens=tokens,
            hashes=hashes,
            offsets=offsets,
            kv_caches=kv_caches,
            slot_mapping=slot_mapping,
            mask=mask,
            stream=stream,
            tenant=tenant,
        )
        loaded = torch.zeros(prepared.num_tokens, dtype=torch.bool)
        header = prepared.header
        locations = check_tiers(conn.welcome, retrieve_locations, "retrieve_locations")
        if locations is not None:
            header["retrieve_locations"] = locations
        if lookup_id is not None:
            header["lookup_id"] = check_lookup_id(lookup_id)
        if req_id is not None:
            header["req_id"] = str(req_id)
        link = await conn.usable()
        if link is None or prepared.num_tokens == 0:
            return loaded
        header["inline"] = link.segment is None
        header["stream"] = True
        try:
            lend = None if lookup_id is None else self._lends.take(header["lookup_id"])
            if lend is not None:
                plain = hashes is None and offsets is None and locations is None
                chunks = await self._lent_chunks(link, prepared, lend, tokens if plain else None)
                if chunks:
                    await self._load_lent(link, prepared, lend, chunks, loaded)
                    return loaded
                self._lends.release(lend)  # its pins stay, for the RETRIEVE
            await self._load_parts(link, prepared, header, loaded)
        except (Unavailable, ProtocolError) as exc:
            log.debug("sidecar_retrieve_missed", error=str(exc))
        return loaded

    async def _lent_chunks(
        self, link: Link, prepared: Prepared, lend: Lend, tokens: Tokens | None
    ) -> list[Chunk]:
        """The chunks of ``lend`` this retrieve loads: those from its first wanted token
        within its tokens, when they are the same tokens' chunks (the digests of ``tokens``
        against the lookup's), of the same tenant, on the same link and in time; none
        when the lend cannot serve it (``tokens`` None: not a plain retrieve by tokens)."""
        if (
            tokens is None
            or lend.link is not link
            or link.segment is None
            or lend.tenant != prepared.header.get("tenant")
            or anyio.current_time() >= lend.usable_until
        ):
            return []
        first, last = prepared.start, prepared.num_tokens
        wanted = [
            chunk
            for chunk in lend.chunks
            if isinstance(chunk, list)
            and len(chunk) == 4
            and is_strict_int(chunk[0])
            and is_strict_int(chunk[1])
            and chunk[0] >= first
            and chunk[1] <= last
        ]
        try:
            chunks = self._copies.checked_chunks(wanted, prepared)
        except ProtocolError:
            return []
        if not chunks or chunks[0][0] != first:
            return []
        if any(chunk[0] != before[1] for before, chunk in itertools.pairwise(chunks)):
            return []
        welcome = self._conn.welcome
        tenant = prepared.header.get("tenant")
        hasher = self._conn.hasher if tenant is None else self._conn.hasher_for(tenant)
        if welcome is None or hasher is None:
            return []
        size = welcome.chunk_size
        low, high = first // size, -(-chunks[-1][1] // size)
        digests = await chunk_digests(hasher, tokens)
        if b"".join(digests[low:high]) != lend.digests[low * DIGEST_SIZE : high * DIGEST_SIZE]:
            return []
        return chunks

    async def _load_lent(
        self,
        link: Link,
        prepared: Prepared,
        lend: Lend,
        chunks: list[Chunk],
        loaded: torch.Tensor,
    ) -> None:
        """Copy the lent ``chunks`` into the KV caches, marking ``loaded``; the RELEASE
        that ends the lend (the load counted, the lookup's pins dropped) is not waited
        for."""
        tokens_loaded = 0
        try:
            await self._copies.scatter(link, prepared, chunks, [])
            tokens_loaded = mark_loaded(
                loaded, prepared.plan, prepared.slots_cpu, chunks[0][0], chunks[-1][1]
            )
        finally:
            self._lends.release(lend, loaded=tokens_loaded, retrieve=True)

    async def _load_parts(
        self, link: Link, prepared: Prepared, header: dict[str, Any], loaded: torch.Tensor
    ) -> None:
        """Load the run part by part (a RETRIEVE, the scatter, a RELEASE each), marking
        ``loaded``, all within the client's timeout; a part the server says is not the last
        (``"more"``) is followed by one from where it ended, asked for before this one is
        copied (the sidecar reads it from disk or Redis meanwhile). A load given up before
        its last part lets go of the lookup's pins on the server.

        Raises:
            Unavailable, ProtocolError: a part could not be had (what came before it is
                loaded and marked).
        """
        conn = self._conn
        deadline = anyio.current_time() + conn.timeout
        start, part = prepared.start, 0
        more = False  # the last reply's: the server holds the lookup's pins for a next part
        ended = False
        ahead: Sent | None = None  # the next part's RETRIEVE, sent before this part's copy
        try:
            while True:
                reply: Message | None = None
                if ahead is not None:
                    sent, ahead = ahead, None
                    try:
                        reply = await link.reply(sent)
                    except Unavailable:
                        if link.dead:
                            raise
                        # Refused (busy: the session held the part before it, released
                        # since): asked again the plain way.
                left = deadline - anyio.current_time()
                if reply is None:
                    if left <= 0:
                        return
                    header["timeout"] = left
                    reply = await conn.ask(
                        link, MessageType.RETRIEVE, header, prepared.payloads, timeout=left
                    )
                txn = reply.header.get("txn")
                more = reply.header.get("more") is True
                if txn is None:
                    ended = True
                    return
                tokens_loaded = 0
                try:
                    chunks = self._copies.chunks(reply, prepared)
                    if chunks and chunks[0][0] != start:
                        raise ProtocolError(f"a part from token {chunks[0][0]}, not {start}")
                    if more and chunks and left > 0:
                        start, part = chunks[-1][1], part + 1
                        header.update(
                            start=start,
                            part=part,
                            alloc_wait=reply.header.get("alloc_wait"),
                            timeout=left,
                        )
                        ahead = conn.send_ahead(
                            link, MessageType.RETRIEVE, header, prepared.payloads, timeout=left
                        )
                    if chunks:
                        await self._copies.scatter(link, prepared, chunks, reply.payloads)
                        tokens_loaded = mark_loaded(
                            loaded, prepared.plan, prepared.slots_cpu, chunks[0][0], chunks[-1][1]
                        )
                finally:
                    release = {"txn": txn, "loaded": tokens_loaded}
                    await link.notify(MessageType.RELEASE, release, conn.timeout)
                if not more or not chunks:
                    ended = True
                    return
        finally:
            if ahead is not None:
                link.forget(ahead)  # its part, if lent, is given back
            if not ended and (more or part) and "lookup_id" in header:
                # Given up between parts (out of time, or a part failed): the server may
                # hold the lookup's pins for the next one.
                unpin = {"lookup_id": header["lookup_id"]}
                await link.notify(MessageType.UNPIN, unpin, conn.timeout)
