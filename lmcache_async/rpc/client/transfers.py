"""A client's data path: STORE then COMMIT, RETRIEVE then RELEASE, with the KV copies in
between run here, through the same transfer plans and copy path
(:mod:`lmcache_async.core.copy`) as an embedded engine; the sidecar's request core decides
what is stored and loaded.

Only chunk keys and offsets cross the socket when the server's segment is mapped (the
copies go straight into and out of its memory); otherwise the payloads travel inline.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import anyio
import anyio.to_thread
import torch

from lmcache_async.core.copy import gather, mark_loaded, scatter
from lmcache_async.errors import ProtocolError
from lmcache_async.keys.tokens import Tokens, check_mask, is_strict_int
from lmcache_async.layouts import KVCacheViews, KVLayout
from lmcache_async.logging import get_logger
from lmcache_async.rpc.client.connection import Connection
from lmcache_async.rpc.client.link import Link
from lmcache_async.rpc.client.welcome import check_tiers
from lmcache_async.rpc.client.wire import Unavailable, check_lookup_id, count, key_fields
from lmcache_async.rpc.protocol import Message, MessageType, put_tenant
from lmcache_async.transfer.cuda import CallerStream, Transfers, caller_stream
from lmcache_async.transfer.plan import TransferPlan

__all__ = ["DataPath"]

log = get_logger(__name__)

_Chunk: TypeAlias = tuple[int, int, int, int]  # start, end, offset, nbytes


@dataclass(slots=True)
class _Prepared:
    """A store or retrieve checked here: its key fields, its transfer plan and, for CUDA
    caches, the point on the caller's stream its copies are ordered against."""

    header: dict[str, Any]
    payloads: list[memoryview]
    num_tokens: int
    start: int
    plan: TransferPlan
    slots_cpu: torch.Tensor
    caller: CallerStream | None


class DataPath:
    """Stores and retrieves over ``conn`` between the serving engine's KV caches (checked
    against ``layout`` once, by ``kv_views``) and the sidecar's payloads, the copies run
    by ``transfers``."""

    def __init__(
        self,
        conn: Connection,
        layout: KVLayout,
        kv_views: KVCacheViews,
        transfers: Transfers,
    ) -> None:
        self._conn = conn
        self._layout = layout
        self._kv_views = kv_views
        self._transfers = transfers

    async def aclose(self) -> None:
        """Stop the copy threads and forget the KV caches seen (shielded)."""
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self._transfers.close)
        self._kv_views.forget()

    def _prepare(
        self,
        *,
        tokens: Tokens | None,
        hashes: Sequence[int | bytes] | None,
        offsets: Sequence[int] | None,
        kv_caches: Sequence[torch.Tensor],
        slot_mapping: torch.Tensor,
        mask: torch.Tensor | None,
        stream: torch.cuda.Stream | None,
        tenant: str | None,
    ) -> _Prepared:
        header, payloads, num_tokens = key_fields(tokens, hashes, offsets)
        put_tenant(header, tenant)
        welcome = self._conn.welcome
        chunk_size = welcome.chunk_size if welcome is not None else 1
        start = check_mask(mask, num_tokens, chunk_size)
        plan, slots_cpu = self._kv_views.plan(kv_caches, slot_mapping, num_tokens)
        caller = caller_stream(plan.device, stream) if plan.device.type == "cuda" else None
        header["start"] = start
        return _Prepared(header, payloads, num_tokens, start, plan, slots_cpu, caller)

    def _chunks(self, reply: Message, prepared: _Prepared) -> list[_Chunk]:
        """The ``(start, end, offset, nbytes)`` of each chunk a reply lends, checked.

        Raises:
            ProtocolError: a malformed chunk, or one that does not fit the request.
        """
        raw = reply.header.get("chunks")
        if not isinstance(raw, list):
            raise ProtocolError("the reply has no 'chunks' list")
        chunks: list[_Chunk] = []
        itemsize = self._layout.dtype.itemsize
        for item in raw:
            if (
                not isinstance(item, list)
                or len(item) != 4
                or not all(is_strict_int(value) for value in item)
            ):
                raise ProtocolError("a chunk must be [start, end, offset, nbytes]")
            start, end, offset, nbytes = item
            expected = math.prod(self._layout.payload_shape(max(end - start, 0))) * itemsize
            if not prepared.start <= start < end <= prepared.num_tokens or nbytes != expected:
                raise ProtocolError(f"chunk {item} does not fit the request")
            chunks.append((start, end, offset, nbytes))
        return chunks

    # -- store ----------------------------------------------------------------------------

    async def store(
        self,
        tokens: Tokens | None,
        *,
        kv_caches: Sequence[torch.Tensor],
        slot_mapping: torch.Tensor,
        mask: torch.Tensor | None,
        req_id: str | None,
        hashes: Sequence[int | bytes] | None,
        offsets: Sequence[int] | None,
        store_location: Sequence[str] | None,
        stream: torch.cuda.Stream | None = None,
        tenant: str | None = None,
    ) -> int:
        """As :meth:`RemoteCacheEngine.store`.

        Raises:
            InvalidInputError: bad input (nothing stored).
            EngineClosedError: the client is closed.
        """
        conn = self._conn
        conn.check_open()
        prepared = self._prepare(
            tokens=tokens,
            hashes=hashes,
            offsets=offsets,
            kv_caches=kv_caches,
            slot_mapping=slot_mapping,
            mask=mask,
            stream=stream,
            tenant=tenant,
        )
        header = prepared.header
        locations = check_tiers(conn.welcome, store_location, "store_location")
        if locations is not None:
            header["store_location"] = locations
        skipped = prepared.plan.first_skipped(prepared.start)
        header["limit"] = prepared.num_tokens if skipped is None else skipped
        header["timeout"] = conn.timeout
        if req_id is not None:
            header["req_id"] = str(req_id)
        link = await conn.usable()
        if link is None or prepared.num_tokens == 0:
            return 0
        # STORE and COMMIT together wait no longer than the client's timeout.
        deadline = anyio.current_time() + conn.timeout
        try:
            reply = await conn.ask(link, MessageType.STORE, header, prepared.payloads)
            if "stored" in reply.header:
                return count(reply, "stored")
            txn = reply.header.get("txn")
            try:
                chunks = self._chunks(reply, prepared)
                payloads = await self._gather(link, prepared, chunks)
            except BaseException:
                abort = {"txn": txn, "abort": True}
                await link.notify(MessageType.COMMIT, abort, conn.timeout)
                raise
            left = deadline - anyio.current_time()
            if left <= 0:
                abort = {"txn": txn, "abort": True}
                await link.notify(MessageType.COMMIT, abort, conn.timeout)
                return 0
            reply = await conn.ask(link, MessageType.COMMIT, {"txn": txn}, payloads, timeout=left)
            return count(reply, "stored")
        except (Unavailable, ProtocolError) as exc:
            log.debug("sidecar_store_missed", error=str(exc))
            return 0

    async def _gather(
        self, link: Link, prepared: _Prepared, chunks: list[_Chunk]
    ) -> list[memoryview]:
        """Copy the chunks out of the KV caches into the lent payloads: the server's
        memory, or local buffers returned as inline frames."""
        layout = self._layout
        dtype = layout.dtype
        segment = link.segment
        with contextlib.ExitStack() as stack:
            if segment is not None:
                stack.enter_context(segment.use())
                outs = [
                    segment.view(off, size, layout.payload_shape(end - start), dtype)
                    for start, end, off, size in chunks
                ]
            else:
                outs = [
                    torch.empty(layout.payload_shape(end - start), dtype=dtype)
                    for start, end, _, _ in chunks
                ]
            jobs = [(start, end, out) for (start, end, _, _), out in zip(chunks, outs, strict=True)]
            # Shielded: the payloads must not be handed back while a copy writes into them.
            with anyio.CancelScope(shield=True):
                await gather(
                    self._transfers,
                    prepared.plan,
                    jobs,
                    timeout=self._conn.timeout,
                    caller=prepared.caller,
                )
            if segment is not None:
                return []
            return [out.view(-1).view(torch.uint8).numpy().data for out in outs]

    # -- retrieve -------------------------------------------------------------------------

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
        prepared = self._prepare(
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
            await self._load_parts(link, prepared, header, loaded)
        except (Unavailable, ProtocolError) as exc:
            log.debug("sidecar_retrieve_missed", error=str(exc))
        return loaded

    async def _load_parts(
        self, link: Link, prepared: _Prepared, header: dict[str, Any], loaded: torch.Tensor
    ) -> None:
        """Load the run part by part (a RETRIEVE, the scatter, a RELEASE each), marking
        ``loaded``, all within the client's timeout; a part the server says is not the last
        (``"more"``) is followed by one from where it ended. A load given up before its last
        part lets go of the lookup's pins on the server.

        Raises:
            Unavailable, ProtocolError: a part could not be had (what came before it is
                loaded and marked).
        """
        conn = self._conn
        deadline = anyio.current_time() + conn.timeout
        start, part = prepared.start, 0
        more = False  # the last reply's: the server holds the lookup's pins for a next part
        ended = False
        try:
            while True:
                left = deadline - anyio.current_time()
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
                    chunks = self._chunks(reply, prepared)
                    if chunks and chunks[0][0] != start:
                        raise ProtocolError(f"a part from token {chunks[0][0]}, not {start}")
                    if chunks:
                        await self._scatter(link, prepared, chunks, reply.payloads)
                        tokens_loaded = mark_loaded(
                            loaded, prepared.plan, prepared.slots_cpu, chunks[0][0], chunks[-1][1]
                        )
                finally:
                    release = {"txn": txn, "loaded": tokens_loaded}
                    await link.notify(MessageType.RELEASE, release, conn.timeout)
                if not more or not chunks:
                    ended = True
                    return
                start, part = chunks[-1][1], part + 1
                header.update(start=start, part=part, alloc_wait=reply.header.get("alloc_wait"))
        finally:
            if not ended and (more or part) and "lookup_id" in header:
                # Given up between parts (out of time, or a part failed): the server may
                # hold the lookup's pins for the next one.
                unpin = {"lookup_id": header["lookup_id"]}
                await link.notify(MessageType.UNPIN, unpin, conn.timeout)

    async def _scatter(
        self,
        link: Link,
        prepared: _Prepared,
        chunks: list[_Chunk],
        frames: list[memoryview],
    ) -> None:
        """Copy the lent payloads (the server's memory, or inline ``frames``) into the KV
        caches.

        Raises:
            ProtocolError: the inline frames do not match the chunks.
        """
        layout = self._layout
        dtype = layout.dtype
        segment = link.segment
        with contextlib.ExitStack() as stack:
            if segment is not None:
                stack.enter_context(segment.use())
                payloads = [
                    segment.view(off, size, layout.payload_shape(end - start), dtype)
                    for start, end, off, size in chunks
                ]
            else:
                if len(frames) != len(chunks):
                    raise ProtocolError(f"{len(frames)} payloads for {len(chunks)} chunks")
                payloads = []
                with warnings.catch_warnings():
                    # The frames are read-only; the scatter only reads them.
                    warnings.simplefilter("ignore", UserWarning)
                    for (start, end, _, size), frame in zip(chunks, frames, strict=True):
                        if frame.nbytes != size:
                            raise ProtocolError(f"a payload of {frame.nbytes} bytes, not {size}")
                        flat = torch.frombuffer(frame, dtype=torch.uint8)
                        shape = layout.payload_shape(end - start)
                        payloads.append(flat.view(dtype).view(shape))
            jobs = [
                (start, end, payload)
                for (start, end, _, _), payload in zip(chunks, payloads, strict=True)
            ]
            with anyio.CancelScope(shield=True):
                await scatter(
                    self._transfers,
                    prepared.plan,
                    jobs,
                    timeout=self._conn.timeout,
                    caller=prepared.caller,
                )
