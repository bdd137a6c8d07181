"""PUSH: another instance's payloads, inline with their checksums, each copied in and
verified before the leading run that passes is cached through the request core's store
(MOVE, which sends them, is in :mod:`~lmcache_async.rpc.sidecar.moves`). What a push
reports is written: it waits for the queued disk and Redis writes (a move may delete its
source next).
"""

from __future__ import annotations

from typing import Any, Final

import anyio
import anyio.to_thread
import numpy as np

from lmcache_async.backends.record import payload_checksum
from lmcache_async.core import RequestCore
from lmcache_async.core.store import release
from lmcache_async.engine import CacheEngine
from lmcache_async.errors import ProtocolError
from lmcache_async.logging import get_logger
from lmcache_async.memory.pool import MemoryObj
from lmcache_async.rpc.protocol import Message
from lmcache_async.rpc.sidecar.fields import (
    checksums_field,
    locations_field,
    max_prompt_chunks,
    request_spans,
    seconds_field,
)
from lmcache_async.rpc.sidecar.host import EngineHost
from lmcache_async.rpc.sidecar.routes import Reply
from lmcache_async.rpc.sidecar.sessions import Session

__all__ = ["PushHandler"]

log = get_logger(__name__)

_INLINE_COPY_BYTES: Final = 4 << 20  # bigger pushes are copied and verified in a worker thread


class PushHandler:
    """PUSH requests, on the engine and arena ``host`` holds."""

    def __init__(self, host: EngineHost) -> None:
        self._host = host
        settings = host.settings
        self._max_chunks = max_prompt_chunks(settings.limits, settings.config.chunk_size)

    async def on_push(self, session: Session | None, message: Message) -> Reply:
        """Cache chunks another instance pushed inline, each verified against its checksum
        first; the leading run that passes is stored through the core, the rest refused."""
        assert session is not None
        engine = self._host.need_engine()
        store = engine.core.store
        header = message.header
        if "hashes" in header or not message.payloads:
            raise ProtocolError("a push carries a token frame, then the chunk payloads")
        frames = message.payloads[1:]
        checksums = checksums_field(header, len(frames))
        locations = engine.check_locations(
            locations_field(header, "store_location"), "store_location"
        )
        spans, tokens = await request_spans(engine, message, self._max_chunks)
        spans = spans[: len(frames)]
        if not store.open() or not spans:
            return {"stored": 0, "chunks": 0, "refused": len(frames)}, ()
        txn = store.begin(
            str(header.get("req_id", session.label)),
            spans,
            tokens,
            limit=None,
            locations=locations,
        )
        objs = await store.reserve(txn, txn.todo)
        todo = txn.todo[: len(objs)]
        try:
            good = await self._verify(
                engine.core,
                session.label,
                objs,
                [frames[index] for index in todo],
                [checksums[index] for index in todo],
            )
            taken, objs = objs[:good], objs[good:]
            await store.commit(txn, todo[:good], taken)
        except BaseException:
            store.abort(txn, objs)
            raise
        release(objs)  # refused: a bad checksum or size, and what came after it
        kept = next((index for index, ok in enumerate(txn.stored) if not ok), len(txn.stored))
        stored = store.finish(txn)
        if kept:
            await self._flush_push(engine, header)
        return {"stored": stored, "chunks": kept, "refused": len(frames) - kept}, ()

    async def _verify(
        self,
        core: RequestCore,
        client: str,
        objs: list[MemoryObj],
        frames: list[memoryview],
        checksums: list[int],
    ) -> int:
        """Copy each frame into its payload and check the copy against its checksum (kept
        on the object); returns how many leading payloads passed."""
        for index, (obj, frame) in enumerate(zip(objs, frames, strict=True)):
            if frame.nbytes != obj.nbytes:
                log.warning(
                    "push_chunk_refused",
                    client=client,
                    chunk=index,
                    reason=f"{frame.nbytes} bytes, the chunk holds {obj.nbytes}",
                )
                objs, frames = objs[:index], frames[:index]
                break
        arena = np.frombuffer(self._host.need_buffer(), dtype=np.uint8)
        jobs = [
            (
                arena[core.buffer_offset(obj) : core.buffer_offset(obj) + obj.nbytes],
                np.frombuffer(frame, dtype=np.uint8),
            )
            for obj, frame in zip(objs, frames, strict=True)
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
            good = verify()
        else:
            good = await anyio.to_thread.run_sync(verify)
        if good < len(objs):
            log.warning("push_chunk_refused", client=client, chunk=good, reason="bad checksum")
        return good

    async def _flush_push(self, engine: CacheEngine, header: dict[str, Any]) -> None:
        """Wait for queued disk and Redis writes, within half the pusher's patience, so
        what a push reports is written (a move may delete its source next)."""
        wait = seconds_field(header, "timeout")
        limit = (
            engine.config.store_timeout
            if wait is None
            else min(wait / 2, engine.config.store_timeout)
        )
        if not await engine.flush(limit):
            log.warning("push_flush_timed_out", seconds=limit)
