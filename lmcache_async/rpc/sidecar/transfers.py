"""The data path: STORE/COMMIT and RETRIEVE/RELEASE (PUSH from another instance is in
:mod:`~.pushes`).

Every request about a prompt may name its tenant (``"tenant"``): its chunks are keyed for
that tenant, so no other tenant's request finds them.

- store: STORE (tokens or block hashes) → the chunks the engine has are held, the others
  allocated and their offsets replied in a *transaction* → the client gathers its KV into
  them → COMMIT (payloads inline from another host) → they go into the engine's tiers.
  When the commit cannot keep fewer than it is given (the CPU tier takes them and no
  slow-tier write is waited for: :meth:`StoreCore.promised`), the STORE's reply says what
  it will count (``"promised"``), and a COMMIT that says ``"quiet"`` gets no reply: the
  client does not wait for it, and the session's later requests wait for it here
  (:data:`~.sessions.AFTER_COMMITS`). A STORE sent ahead with a pinned LOOKUP
  (``"ahead"``: :mod:`lmcache_async.rpc.client.ahead`) is served after the session's
  lookups read before it;
- retrieve: RETRIEVE → the chunks are fetched (from disk or Redis too) and held in a
  transaction, replied as offsets (or inline) → the client scatters them → RELEASE. A
  client that says it streams (``"stream"``) is served a batch of chunks at a time
  (``"more"`` in the reply: ask again from where it ended, ``"part"`` counting up), so a
  load never holds more than a batch of new memory; the lookup's pins hold until the last
  part. The tokens a RELEASE says were loaded are counted (``retrieved_tokens``) only up
  to what its transaction lent: a client's figure never inflates the engine's. A RELEASE
  of a pinned LOOKUP's lend (:mod:`~.lookups`) says ``"retrieve"`` (a load served from
  it: counted, the pins dropped), ``"unpin"`` (the pins dropped) or neither.

The handlers decode a message and run the engine's request core (``engine.core``): a
STORE is the core's store reserve, its COMMIT the core's commit (or abort), a RETRIEVE the
core's load reserve and its RELEASE the core's release, exactly as the embedded pipelines
run them. Nothing here decides what is stored or loaded; the payloads live in the
shared-memory arena.

Deadlines: a STORE or RETRIEVE says how long its client waits (``"timeout"``); the work
here takes at most half of that (:data:`SERVE_SHARE`), so the answer, a miss at worst,
comes before the client gives up. Its waits for pool memory share one
:class:`~lmcache_async.memory.pool.AllocationBudget` (``allocation_timeout`` at most, over every
part of a streamed load: ``"alloc_wait"`` goes back and forth with what is left), and a
batch that has taken memory does not wait for more.
"""

from __future__ import annotations

import math
from typing import Any, Final

import anyio
import anyio.to_thread
import numpy as np

from lmcache_async.core import RequestCore
from lmcache_async.core.load import read_batch_chunks
from lmcache_async.engine import CacheEngine
from lmcache_async.errors import ProtocolError
from lmcache_async.keys.chunks import ChunkSpan
from lmcache_async.logging import get_logger
from lmcache_async.memory.pool import AllocationBudget, MemoryObj
from lmcache_async.rpc.protocol import Message, MessageType
from lmcache_async.rpc.sidecar import read_ahead
from lmcache_async.rpc.sidecar.fields import (
    flag_field,
    int_field,
    label_field,
    locations_field,
    lookup_id_field,
    max_prompt_chunks,
    request_spans,
    seconds_field,
    txn_deadline,
)
from lmcache_async.rpc.sidecar.host import EngineHost
from lmcache_async.rpc.sidecar.routes import Reply
from lmcache_async.rpc.sidecar.sessions import Session, Sessions, Transaction

__all__ = ["TransferHandlers"]

log = get_logger(__name__)

_INLINE_COPY_BYTES: Final = 4 << 20  # bigger inline payloads are copied in a worker thread

SERVE_SHARE: Final = 0.5
"""The share of a client's wait (its request's ``"timeout"``) that serving the request here
may take: the rest is for the reply, the client's copies and its next part."""

LOAD_POOL_SHARE: Final = 8
"""A part of a streamed load holds at most this fraction of the pool (and at most
``pipeline_batch_chunks`` chunks), so several loads stream through the pool at once."""


class TransferHandlers:
    """The data-path requests, on the engine and arena ``host`` holds; transactions are
    kept in the client's session and numbered by ``sessions``."""

    def __init__(self, host: EngineHost, sessions: Sessions) -> None:
        self._host = host
        self._sessions = sessions
        settings = host.settings
        self._max_chunks = max_prompt_chunks(settings.limits, settings.config.chunk_size)

    # -- store ----------------------------------------------------------------------------

    async def on_store(self, session: Session | None, message: Message) -> Reply:
        assert session is not None
        session.check_room(self._host.settings.max_session_transactions)
        engine = self._host.need_engine()
        if flag_field(message.header, "ahead"):
            # Sent with a pinned lookup: after it, so that it evicts nothing it pins.
            await session.lookups.settled(engine.config.store_timeout)
        core = engine.core
        header = message.header
        locations = engine.check_locations(
            locations_field(header, "store_location"), "store_location"
        )
        # Every field is read before the core holds anything a bad one would leave held.
        req_id = label_field(header, "req_id", session.label)
        # No chunk ending after the client's limit (its first negative slot) is stored.
        limit = int_field(header, "limit", 0) if "limit" in header else None
        patience = _patience(header, engine.config.store_timeout)
        spans, tokens = await request_spans(engine, message, self._max_chunks)
        if not core.store.open():
            return {"stored": 0}, ()
        txn = core.store.begin(
            req_id,
            spans,
            tokens,
            limit=limit,
            locations=locations,
        )
        objs: list[MemoryObj] = []
        todo = txn.todo[: self._within_share(engine, session, [txn.spans[i] for i in txn.todo])]
        budget = AllocationBudget(min(engine.config.allocation_timeout, patience))
        with budget.scope(), anyio.move_on_after(patience):
            objs = await core.store.reserve(txn, todo) if todo else []
        if not objs:
            return {"stored": core.store.finish(txn)}, ()
        lent = Transaction(
            self._sessions.next_txn_id(),
            MessageType.STORE,
            txn_deadline(header, engine.config.store_timeout),
            [txn.spans[index] for index in txn.todo[: len(objs)]],
            objs,
            store=txn,
            store_core=core.store,
        )
        session.transactions[lent.txn_id] = lent
        chunks = [
            [span.start, span.end, core.buffer_offset(obj), obj.nbytes]
            for span, obj in zip(lent.spans, objs, strict=True)
        ]
        reply: dict[str, Any] = {"txn": lent.txn_id, "chunks": chunks}
        promised = core.store.promised(txn, txn.todo[: len(objs)])
        if promised is not None:
            reply["promised"] = promised
        return reply, ()

    def _within_share(self, engine: CacheEngine, session: Session, spans: list[ChunkSpan]) -> int:
        """How many leading ``spans`` a STORE may reserve: those that keep the session's
        open transactions within ``max_session_pool_share`` of the pool (in the pool's
        whole pages), so no one client holds the memory every other client stores into.
        Every span is a whole chunk but a prompt's short last one."""
        pool, layout = engine.core.pool, engine.layout
        page, itemsize = pool.page_size, layout.dtype.itemsize

        def footprint(tokens: int) -> int:
            nbytes = math.prod(layout.payload_shape(tokens)) * itemsize
            return -(-nbytes // page) * page

        room = self._host.settings.max_session_pool_share * pool.capacity_bytes
        room -= session.held_bytes(page)
        count = min(len(spans), max(0, int(room // footprint(engine.config.chunk_size))))
        if count == len(spans) - 1 and room - count * footprint(
            engine.config.chunk_size
        ) >= footprint(spans[-1].num_tokens):
            count += 1  # a short last chunk fits where a whole one would not
        return count

    async def on_commit(self, session: Session | None, message: Message) -> Reply | None:
        assert session is not None
        core = self._host.need_engine().core
        lent = session.take(message, MessageType.STORE)
        if lent is None or lent.store is None:
            return {"stored": 0, "expired": True}, ()
        txn = lent.store
        quiet = flag_field(message.header, "quiet")  # the client took the promised count
        try:
            if flag_field(message.header, "abort"):
                return {"stored": 0}, ()
            if message.payloads:
                await self._fill(core, lent, message.payloads)
            objs, lent.objs = lent.objs, []  # the commit gives them back
            await core.store.commit(txn, txn.todo[: len(objs)], objs)
            stored = core.store.finish(txn)
            return None if quiet else ({"stored": stored}, ())
        finally:
            lent.release()  # an abort, a bad frame: every payload back, nothing counted

    async def _fill(self, core: RequestCore, txn: Transaction, payloads: list[memoryview]) -> None:
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
            offset = core.buffer_offset(obj)
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
        session.check_room(self._host.settings.max_session_transactions)
        engine = self._host.need_engine()
        load = engine.core.load
        header = message.header
        lookup_id = lookup_id_field(header, required=False)
        scoped = None if lookup_id is None else session.scoped(lookup_id)
        stream = flag_field(header, "stream")
        inline = flag_field(header, "inline")  # read first: a bad field leaves nothing lent
        part = int_field(header, "part", 0) if stream else 0
        patience = _patience(header, engine.config.retrieve_timeout)
        budget = AllocationBudget(_allowance(header, engine.config.allocation_timeout, patience))
        objs: list[MemoryObj] = []
        more = False
        started = next_first = None  # the part after this one, read ahead from the start
        try:
            locations = engine.check_locations(
                locations_field(header, "retrieve_locations"), "retrieve_locations"
            )
            spans, _ = await request_spans(engine, message, self._max_chunks)
            keys = [span.key for span in spans]
            limit = len(keys)
            if stream and keys:  # one batch of the load, within the part's share of the pool
                most = self._part_chunks(engine)
                read = read_batch_chunks(most, self._chunk_bytes(engine))
                first = load.batches(keys, len(keys), locations, read_batch=read)[0]
                limit = min(most, len(first))
                if scoped is None:
                    started = read_ahead.start_next(session, load, keys, limit, locations)
            # Waiting for a prefetch, for memory and for the tiers, all within patience.
            with anyio.move_on_after(patience):
                # A later part of a streamed load was counted (and its prefetch waited
                # for) with the first; without a lookup id, it may have been read ahead.
                serving = part > 0 or await load.begin(scoped)
                ahead = None
                if serving and keys and part > 0 and scoped is None:
                    ahead = await read_ahead.take(session, load, keys[0])
                try:
                    if serving and keys:
                        with budget.scope():
                            pinned = scoped if ahead is None else ahead
                            objs = await load.reserve(keys[:limit], locations, pinned)
                finally:
                    if ahead is not None:
                        load.drop_prefetch(ahead)  # the part holds its payloads now
                # More to come: the part was full, or cut short for memory it held (the
                # next part starts holding none); not after a miss or a refusal.
                more = (
                    stream
                    and 0 < len(objs) < len(keys)
                    and (len(objs) == limit or (budget.cut and not budget.refused))
                )
            if more and scoped is None:
                next_first = keys[len(objs)]
                # The part read from the start is dropped first if it is not the next one
                # (this part was cut short), so it does not count against the session's
                # parts ahead when the right one starts.
                read_ahead.settle(session, load, started, next_first)
                read_ahead.start(session, load, keys[len(objs) : len(objs) + limit], locations)
        finally:
            read_ahead.settle(session, load, started, next_first)  # no-op once settled
            if lookup_id is not None and not more:
                # The payloads are referenced now: the pins have done their job.
                session.lookup_ids.discard(lookup_id)
                load.finish(scoped, 0)
        reply: dict[str, Any] = {"chunks": []}
        if stream:
            reply["more"] = more
            reply["alloc_wait"] = budget.left
        if not objs:
            return reply, ()
        spans = spans[: len(objs)]
        lent = Transaction(
            self._sessions.next_txn_id(),
            MessageType.RETRIEVE,
            txn_deadline(header, engine.config.retrieve_timeout),
            spans,
            objs,
        )
        session.transactions[lent.txn_id] = lent
        offsets = [engine.core.buffer_offset(obj) for obj in objs]
        reply["chunks"] = [
            [span.start, span.end, offset, obj.nbytes]
            for span, obj, offset in zip(spans, objs, offsets, strict=True)
        ]
        reply["txn"] = lent.txn_id
        payloads: list[memoryview] = []
        if inline:
            buffer = self._host.need_buffer()
            payloads = [
                buffer[offset : offset + obj.nbytes]
                for obj, offset in zip(objs, offsets, strict=True)
            ]
        return reply, payloads

    def _part_chunks(self, engine: CacheEngine) -> int:
        """Chunks in one part of a streamed load: ``pipeline_batch_chunks``, and no more
        than :data:`LOAD_POOL_SHARE` parts fill the pool."""
        fits = engine.core.pool.capacity_bytes // (LOAD_POOL_SHARE * self._chunk_bytes(engine))
        return max(1, min(engine.config.pipeline_batch_chunks, fits))

    def _chunk_bytes(self, engine: CacheEngine) -> int:
        """Bytes of a full chunk of the namespace served (of ``chunk_size`` before one is)."""
        namespace = self._host.namespace
        token_bytes = 1 if namespace is None else namespace.layout.token_bytes
        return max(1, engine.config.chunk_size * token_bytes)

    async def on_release(self, session: Session | None, message: Message) -> None:
        """End a retrieve transaction: its payloads go back, and the tokens the client
        says it loaded (``"loaded"``) are counted, at most those the transaction lent.

        Raises:
            ProtocolError: ``txn`` or ``loaded`` is not an int (``loaded``: >= 0); the
                payloads go back all the same.
        """
        assert session is not None
        lent = session.take(message, MessageType.RETRIEVE)
        if lent is None:
            return
        lent.release()
        header = message.header
        # The client's figure is a claim: the counters hold what this sidecar served.
        loaded = min(int_field(header, "loaded", 0), lent.tokens())
        load = self._host.need_engine().core.load
        if lent.lent_for is None:
            load.finish(None, loaded)
            return
        # A lookup's lend: a load served from it ("retrieve"), or let go of with its
        # pins ("unpin") or without them (a RETRIEVE under the lookup id follows).
        scoped = session.scoped(lent.lent_for)
        if flag_field(header, "retrieve"):
            session.lookup_ids.discard(lent.lent_for)
            load.finish_lent(scoped, loaded)
        elif flag_field(header, "unpin"):
            session.lookup_ids.discard(lent.lent_for)
            load.finish(scoped, 0)


def _patience(header: dict[str, Any], longest: float) -> float:
    """How long serving a request may take: :data:`SERVE_SHARE` of the wait its client
    said (``"timeout"``), at most ``longest``."""
    wait = seconds_field(header, "timeout")
    return longest if wait is None else min(longest, wait * SERVE_SHARE)


def _allowance(header: dict[str, Any], allocation_timeout: float, patience: float) -> float:
    """The seconds a load's waits for memory may add up to: ``allocation_timeout``, what an
    earlier part of the same load left (``"alloc_wait"``), and no more than its patience.

    Raises:
        ProtocolError: ``alloc_wait`` is not a number >= 0.
    """
    left = header.get("alloc_wait")
    if left is None:
        return min(allocation_timeout, patience)
    if (
        isinstance(left, bool)
        or not isinstance(left, int | float)
        or not math.isfinite(left)
        or left < 0
    ):
        raise ProtocolError("'alloc_wait' must be a number of seconds >= 0")
    return max(0.0, min(allocation_timeout, patience, float(left)))
