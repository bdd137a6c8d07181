"""The data path: STORE/COMMIT, RETRIEVE/RELEASE, and PUSH/MOVE between instances.

- store: STORE (tokens or block hashes) → the chunks the engine has are held, the others
  allocated and their offsets replied in a *transaction* → the client gathers its KV into
  them → COMMIT (payloads inline from another host) → they go into the engine's tiers;
- retrieve: RETRIEVE → the chunks are fetched (from disk or Redis too) and held in a
  transaction, replied as offsets (or inline) → the client scatters them → RELEASE;
- PUSH: another instance's payloads, inline with their checksums, each copied in and
  verified before the leading run that passes is cached; MOVE: the engine moves a prefix
  to another sidecar.

The handlers speak to the engine in chunks (``chunk_spans``, ``hold_chunks``,
``allocate_chunk``, ``buffer_offset``, ``put_chunks``, ``fetch_chunks``,
``record_request``, ``accepts_writes``); the payloads live in the shared-memory arena.
"""

from __future__ import annotations

from typing import Any, Final

import anyio
import anyio.to_thread
import numpy as np
import structlog

from lmcache_async.backends.record import payload_checksum
from lmcache_async.engine import CacheEngine
from lmcache_async.errors import AllocationTimeoutError, InvalidInputError, ProtocolError
from lmcache_async.keys import ChunkSpan
from lmcache_async.memory import MemoryObj
from lmcache_async.rpc.protocol import Message, MessageType, tokens_from_payload
from lmcache_async.rpc.sidecar.fields import (
    checksums_field,
    flag_field,
    int_field,
    key_input,
    locations_field,
    lookup_id_field,
    seconds_field,
    txn_deadline,
)
from lmcache_async.rpc.sidecar.host import EngineHost
from lmcache_async.rpc.sidecar.routes import Reply
from lmcache_async.rpc.sidecar.sessions import Session, Sessions, Transaction
from lmcache_async.tokens import is_strict_int

__all__ = ["TransferHandlers"]

log = structlog.get_logger(__name__)

_INLINE_COPY_BYTES: Final = 4 << 20  # bigger inline payloads are copied in a worker thread


class TransferHandlers:
    """The data-path requests, on the engine and arena ``host`` holds; transactions are
    kept in the client's session and numbered by ``sessions``."""

    def __init__(self, host: EngineHost, sessions: Sessions) -> None:
        self._host = host
        self._sessions = sessions

    async def _spans(
        self, engine: CacheEngine, message: Message
    ) -> tuple[list[ChunkSpan], np.ndarray | None]:
        """The request's chunks from its ``start`` (the mask's first True) on.

        Raises:
            InvalidInputError: ``start`` is not on a chunk boundary, or bad keys.
        """
        start = int_field(message.header, "start", 0)
        if start % engine.config.chunk_size:
            raise InvalidInputError(
                f"the mask must start on a chunk boundary (chunk_size "
                f"{engine.config.chunk_size}), got {start}"
            )
        tokens, hashes, offsets = key_input(message)
        spans, array = await engine.chunk_spans(tokens, hashes=hashes, offsets=offsets)
        if start:
            spans = [span for span in spans if span.start >= start]
        return spans, array

    # -- store ----------------------------------------------------------------------------

    async def on_store(self, session: Session | None, message: Message) -> Reply:
        assert session is not None
        engine = self._host.need_engine()
        header = message.header
        locations = locations_field(header, "store_location")
        spans, tokens = await self._spans(engine, message)
        if not engine.accepts_writes:
            engine.record_request("store", 0)
            return {"stored": 0}, ()
        limit = header.get("limit")
        if limit is not None:
            limit = int_field(header, "limit", 0)
            spans = [span for span in spans if span.end <= limit]
        present = engine.hold_chunks([span.key for span in spans])
        txn = Transaction(
            self._sessions.next_txn_id(),
            MessageType.STORE,
            txn_deadline(message.header, engine.config.store_timeout),
            spans,
            stored=[obj is not None for obj in present],
            held=[obj for obj in present if obj is not None],
            tokens=tokens,
            locations=locations,
        )
        try:
            for index, obj in enumerate(present):
                if obj is not None:
                    continue
                try:
                    payload = await engine.allocate_chunk(spans[index].num_tokens)
                except AllocationTimeoutError:
                    txn.partial = True
                    log.warning("store_partial", client=session.label, stored_chunks=index)
                    break
                txn.objs.append(payload)
                txn.todo.append(index)
        except BaseException:
            txn.release()
            raise
        if not txn.objs:
            stored = txn.stored_tokens()
            txn.release()
            engine.record_request("store", stored, partial=txn.partial)
            return {"stored": stored}, ()
        session.transactions[txn.txn_id] = txn
        chunks = [
            [spans[i].start, spans[i].end, engine.buffer_offset(obj), obj.nbytes]
            for i, obj in zip(txn.todo, txn.objs, strict=True)
        ]
        return {"txn": txn.txn_id, "chunks": chunks}, ()

    async def on_commit(self, session: Session | None, message: Message) -> Reply:
        assert session is not None
        engine = self._host.need_engine()
        txn = session.take(message, MessageType.STORE)
        if txn is None:
            engine.record_request("store", 0)
            return {"stored": 0, "expired": True}, ()
        try:
            if flag_field(message.header, "abort"):
                engine.record_request("store", 0)
                return {"stored": 0}, ()
            if message.payloads:
                await self._fill(engine, txn, message.payloads)
            spans = [txn.spans[i] for i in txn.todo]
            kept = await engine.put_chunks(
                spans, txn.objs, txn.tokens, store_location=txn.locations
            )
            cached = engine.hold_chunks([span.key for span in spans[:kept]])
            for index, obj in zip(txn.todo[:kept], cached, strict=True):
                txn.stored[index] = True
                if obj is not None:
                    txn.held.append(obj)
            stored = txn.stored_tokens()
            engine.record_request("store", stored, partial=txn.partial)
            return {"stored": stored}, ()
        finally:
            txn.release()

    async def _fill(
        self, engine: CacheEngine, txn: Transaction, payloads: list[memoryview]
    ) -> None:
        """Copy inline payload frames (a client on another host) into the payloads.

        Raises:
            ProtocolError: the frames do not match the transaction's chunks.
        """
        if len(payloads) != len(txn.objs):
            raise ProtocolError(
                f"the commit carries {len(payloads)} payloads for {len(txn.objs)} chunks"
            )
        arena = np.frombuffer(self._host.need_buffer(), dtype=np.uint8)
        jobs: list[tuple[np.ndarray, np.ndarray]] = []
        for index, (obj, payload) in enumerate(zip(txn.objs, payloads, strict=True)):
            if payload.nbytes != obj.nbytes:
                raise ProtocolError(
                    f"payload {index} holds {payload.nbytes} bytes, the chunk {obj.nbytes}"
                )
            offset = engine.buffer_offset(obj)
            jobs.append((arena[offset : offset + obj.nbytes], np.frombuffer(payload, np.uint8)))

        def copy() -> None:
            for dst, src in jobs:
                dst[:] = src

        if sum(obj.nbytes for obj in txn.objs) < _INLINE_COPY_BYTES:
            copy()
        else:
            await anyio.to_thread.run_sync(copy)

    # -- retrieve -------------------------------------------------------------------------

    async def on_retrieve(self, session: Session | None, message: Message) -> Reply:
        assert session is not None
        engine = self._host.need_engine()
        header = message.header
        locations = locations_field(header, "retrieve_locations")
        lookup_id = lookup_id_field(header, required=False)
        scoped = None if lookup_id is None else session.scoped(lookup_id)
        try:
            spans, _ = await self._spans(engine, message)
            objs = await engine.fetch_chunks(
                [span.key for span in spans], lookup_id=scoped, retrieve_locations=locations
            )
        finally:
            if lookup_id is not None and scoped is not None:
                session.lookup_ids.discard(lookup_id)
                await engine.lookup_unpin(scoped)
        if not objs:
            engine.record_request("retrieve", 0)
            return {"chunks": []}, ()
        spans = spans[: len(objs)]
        txn = Transaction(
            self._sessions.next_txn_id(),
            MessageType.RETRIEVE,
            txn_deadline(message.header, engine.config.retrieve_timeout),
            spans,
            objs=objs,
        )
        session.transactions[txn.txn_id] = txn
        offsets = [engine.buffer_offset(obj) for obj in objs]
        chunks = [
            [span.start, span.end, offset, obj.nbytes]
            for span, obj, offset in zip(spans, objs, offsets, strict=True)
        ]
        payloads: list[memoryview] = []
        if flag_field(header, "inline"):
            buffer = self._host.need_buffer()
            payloads = [
                buffer[offset : offset + obj.nbytes]
                for obj, offset in zip(objs, offsets, strict=True)
            ]
        return {"txn": txn.txn_id, "chunks": chunks}, payloads

    async def on_release(self, session: Session | None, message: Message) -> None:
        assert session is not None
        txn = session.take(message, MessageType.RETRIEVE)
        if txn is None:
            return
        txn.release()
        loaded = message.header.get("loaded", 0)
        if is_strict_int(loaded) and loaded >= 0:
            self._host.need_engine().record_request("retrieve", loaded)

    # -- moves between instances ----------------------------------------------------------

    async def on_push(self, session: Session | None, message: Message) -> Reply:
        """Cache chunks another instance pushed inline, each verified against its checksum
        first; the leading run that passes is cached, the rest refused and not counted."""
        assert session is not None
        engine = self._host.need_engine()
        header = message.header
        if "hashes" in header or not message.payloads:
            raise ProtocolError("a push carries a token frame, then the chunk payloads")
        frames = message.payloads[1:]
        checksums = checksums_field(header, len(frames))
        locations = locations_field(header, "store_location")
        spans, tokens = await self._spans(engine, message)
        if not engine.accepts_writes:
            engine.record_request("store", 0)
            return {"stored": 0, "chunks": 0, "refused": len(frames)}, ()
        objs: list[MemoryObj] = []
        try:
            for index, (span, frame) in enumerate(zip(spans, frames, strict=False)):
                try:
                    obj = await engine.allocate_chunk(span.num_tokens)
                except AllocationTimeoutError:
                    log.warning("push_partial", client=session.label, taken_chunks=index)
                    break
                if frame.nbytes != obj.nbytes:
                    obj.unref()
                    log.warning(
                        "push_chunk_refused",
                        client=session.label,
                        chunk=index,
                        reason=f"{frame.nbytes} bytes, the chunk holds {obj.nbytes}",
                    )
                    break
                objs.append(obj)
            good = await self._verify(engine, objs, frames, checksums)
            if good < len(objs):
                log.warning(
                    "push_chunk_refused", client=session.label, chunk=good, reason="bad checksum"
                )
                for obj in objs[good:]:
                    obj.unref()
                del objs[good:]
            kept = 0
            if objs:
                kept = await engine.put_chunks(
                    spans[: len(objs)], objs, tokens, store_location=locations
                )
            if kept:
                await self._flush_push(engine, header)
        finally:
            for obj in objs:
                obj.unref()
        stored = spans[kept - 1].end - spans[0].start if kept else 0
        engine.record_request("store", stored, partial=kept < len(frames))
        return {"stored": stored, "chunks": kept, "refused": len(frames) - kept}, ()

    async def _verify(
        self,
        engine: CacheEngine,
        objs: list[MemoryObj],
        frames: list[memoryview],
        checksums: list[int],
    ) -> int:
        """Copy each frame into its payload and check the copy against its checksum (kept
        on the object); returns how many leading payloads passed."""
        arena = np.frombuffer(self._host.need_buffer(), dtype=np.uint8)
        jobs = [
            (
                arena[engine.buffer_offset(obj) : engine.buffer_offset(obj) + obj.nbytes],
                np.frombuffer(frame, dtype=np.uint8),
            )
            for obj, frame in zip(objs, frames, strict=False)
        ]

        def verify() -> int:
            for index, ((dst, src), obj) in enumerate(zip(jobs, objs, strict=True)):
                dst[:] = src
                checksum = payload_checksum(dst.data)
                if checksum != checksums[index]:
                    return index
                obj.checksum = checksum
            return len(jobs)

        if sum(obj.nbytes for obj in objs) < _INLINE_COPY_BYTES:
            return verify()
        return await anyio.to_thread.run_sync(verify)

    async def _flush_push(self, engine: CacheEngine, header: dict[str, Any]) -> None:
        """Wait for queued disk and Redis writes, within half the pusher's patience, so
        what a push reports is written (a move may delete its source next)."""
        wait = seconds_field(header, "timeout")
        limit = engine.config.store_timeout if wait is None else wait / 2
        if not await engine.flush(limit):
            log.warning("push_flush_timed_out", seconds=limit)

    async def on_move(self, session: Session | None, message: Message) -> Reply:
        engine = self._host.need_engine()
        header = message.header
        if len(message.payloads) != 1:
            raise ProtocolError("a move carries exactly one token frame")
        tokens = tokens_from_payload(message.payloads[0])
        # Both positions are checked by the engine, which names what is wrong.
        old_position: Any = header.get("old_position")
        new_position: Any = header.get("new_position")
        copy = flag_field(header, "copy", required=True)
        moved = await engine.move(
            tokens, old_position, new_position, copy, timeout=seconds_field(header, "timeout")
        )
        return {"moved": moved}, ()
