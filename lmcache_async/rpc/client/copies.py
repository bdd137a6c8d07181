"""What a client's stores and retrieves share: a request checked against the serving
engine's KV caches (:class:`Prepared`), the chunks a reply lends, checked, and the copies
into and out of them, run through the same transfer plans and copy path
(:mod:`lmcache_async.core.copy`) as an embedded engine.

Only chunk keys and offsets cross the socket when the server's segment is mapped (the
copies go straight into and out of its memory); otherwise the payloads travel inline.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import anyio
import anyio.to_thread
import torch

from lmcache_async.core.copy import gather, scatter
from lmcache_async.errors import ProtocolError
from lmcache_async.keys.tokens import Tokens, check_mask, is_strict_int
from lmcache_async.layouts import KVCacheViews, KVLayout
from lmcache_async.rpc.client.connection import Connection
from lmcache_async.rpc.client.link import Link
from lmcache_async.rpc.client.segment import Segment
from lmcache_async.rpc.client.wire import key_fields
from lmcache_async.rpc.protocol import Message, put_tenant
from lmcache_async.transfer.cuda import CallerStream, Transfers, caller_stream
from lmcache_async.transfer.plan import TransferPlan

__all__ = ["Chunk", "CopyPath", "Prepared"]

Chunk: TypeAlias = tuple[int, int, int, int]  # start, end, offset, nbytes


@dataclass(slots=True)
class Prepared:
    """A store or retrieve checked here: its key fields, its transfer plan and, for CUDA
    caches, the point on the caller's stream its copies are ordered against."""

    header: dict[str, Any]
    payloads: list[memoryview]
    num_tokens: int
    start: int
    plan: TransferPlan
    slots_cpu: torch.Tensor
    caller: CallerStream | None


class CopyPath:
    """Requests checked against the serving engine's KV caches (against ``layout`` once,
    by ``kv_views``) and the copies between them and the sidecar's payloads, run by
    ``transfers`` within ``conn``'s timeout."""

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

    def prepare(
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
    ) -> Prepared:
        header, payloads, num_tokens = key_fields(tokens, hashes, offsets)
        put_tenant(header, tenant)
        welcome = self._conn.welcome
        chunk_size = welcome.chunk_size if welcome is not None else 1
        start = check_mask(mask, num_tokens, chunk_size)
        plan, slots_cpu = self._kv_views.plan(kv_caches, slot_mapping, num_tokens)
        caller = caller_stream(plan.device, stream) if plan.device.type == "cuda" else None
        header["start"] = start
        return Prepared(header, payloads, num_tokens, start, plan, slots_cpu, caller)

    def chunks(self, reply: Message, prepared: Prepared) -> list[Chunk]:
        """The ``(start, end, offset, nbytes)`` of each chunk a reply lends, checked.

        Raises:
            ProtocolError: a malformed chunk, or one that does not fit the request.
        """
        return self.checked_chunks(reply.header.get("chunks"), prepared)

    def checked_chunks(self, raw: object, prepared: Prepared) -> list[Chunk]:
        """``raw`` as a list of ``(start, end, offset, nbytes)`` within the request.

        Raises:
            ProtocolError: a malformed chunk, or one that does not fit the request.
        """
        if not isinstance(raw, list):
            raise ProtocolError("the reply has no 'chunks' list")
        chunks: list[Chunk] = []
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

    def _views(self, segment: Segment, chunks: list[Chunk]) -> list[torch.Tensor]:
        """The lent chunks' payloads in the mapped segment (while it is in use)."""
        layout = self._layout
        return [
            segment.view(offset, size, layout.payload_shape(end - start), layout.dtype)
            for start, end, offset, size in chunks
        ]

    async def gather(self, link: Link, prepared: Prepared, chunks: list[Chunk]) -> list[memoryview]:
        """Copy the chunks out of the KV caches into the lent payloads: the server's
        memory, or local buffers returned as inline frames."""
        layout = self._layout
        dtype = layout.dtype
        segment = link.segment
        with contextlib.ExitStack() as stack:
            if segment is not None:
                stack.enter_context(segment.use())
                outs = self._views(segment, chunks)
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

    async def scatter(
        self,
        link: Link,
        prepared: Prepared,
        chunks: list[Chunk],
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
                payloads = self._views(segment, chunks)
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
