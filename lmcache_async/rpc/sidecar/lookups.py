"""LOOKUP, PREFETCH and UNPIN: how much of a prompt the sidecar holds, what it promises
(a LOOKUP with ``"promise": true``: :meth:`CacheEngine.promise`), and its pins.

Lookup ids are scoped to the client's session (:meth:`Session.scoped`); the ids a session
pins with are remembered, so its pins go when it does. A LOOKUP by chunk digests that the
CPU tier answers alone is served in the socket's reader callback (:meth:`LookupHandlers.now`).
A pinned LOOKUP by digests that says ``"lend": true`` (a client that maps the sidecar's
segment) is answered with the pinned chunks' offsets too, held in a transaction
(``"txn"``, ``"chunks"`` as a RETRIEVE lends them, ``"ttl"``: seconds before the pins
expire): the client copies its hit out of them with no RETRIEVE, and its RELEASE with
``"retrieve": true`` counts the load and drops the pins, as the retrieve would have. A
lend is made only when the pinned chunks are the whole hit. A session's LOOKUP waits
for the COMMITs it sent before it (:attr:`Session.commits`).
Each request may name the tenant whose prompt it is (``"tenant"``; none: the session's own);
digests must then be that tenant's (the engine refuses another's). Every field is read
checked (:mod:`~.fields`): a request names at most as many chunks as the longest prompt
within the sidecar's message limits.
"""

from __future__ import annotations

from typing import Any

from lmcache_async.engine import CacheEngine
from lmcache_async.engine.client import check_promise_wait
from lmcache_async.rpc.protocol import Message, MessageType, tenant_of
from lmcache_async.rpc.sidecar.fields import (
    digests_frame,
    flag_field,
    int_field,
    key_input,
    locations_field,
    lookup_id_field,
    max_prompt_chunks,
    txn_deadline,
)
from lmcache_async.rpc.sidecar.host import EngineHost
from lmcache_async.rpc.sidecar.routes import Reply
from lmcache_async.rpc.sidecar.sessions import Session, Sessions, Transaction

__all__ = ["LookupHandlers", "pin_fields"]


def pin_fields(
    session: Session, header: dict[str, Any]
) -> tuple[bool, int | str | None, tuple[str, bytes, int | str] | None]:
    """A LOOKUP's ``pin`` flag, its ``lookup_id`` (required with a pin) and that id as
    scoped to ``session``.

    Raises:
        ProtocolError: a malformed field.
        InvalidInputError: a pin without a lookup id.
    """
    pin = flag_field(header, "pin")
    lookup_id = lookup_id_field(header, required=pin)
    return pin, lookup_id, None if lookup_id is None else session.scoped(lookup_id)


def _forget_empty(
    session: Session, engine: CacheEngine, pin: bool, lookup_id: int | str | None, hits: int
) -> None:
    """A pinned lookup that found nothing holds nothing: its id is forgotten here (and any
    pins an earlier lookup took under it released), so the client owes no UNPIN for it."""
    if pin and hits == 0 and lookup_id is not None:
        session.lookup_ids.discard(lookup_id)
        engine.lookup_unpin_now(session.scoped(lookup_id))


class LookupHandlers:
    """The lookup requests, answered by the engine ``host`` holds."""

    def __init__(self, host: EngineHost, sessions: Sessions) -> None:
        self._host = host
        self._sessions = sessions
        settings = host.settings
        self._max_chunks = max_prompt_chunks(settings.limits, settings.config.chunk_size)
        self._max_pins = settings.max_session_pins
        self._max_txns = settings.max_session_transactions

    def _answer(
        self,
        session: Session,
        engine: CacheEngine,
        header: dict[str, Any],
        lookup_id: int | str | None,
        hits: int,
    ) -> dict[str, Any]:
        """The reply to a lookup that found ``hits`` tokens: with the pinned chunks lent
        when the client asked for them and they are the whole hit."""
        reply: dict[str, Any] = {"hits": hits}
        if (
            not hits
            or lookup_id is None
            or not flag_field(header, "lend")
            or session.lends() >= self._max_txns
        ):
            return reply
        core = engine.core
        objs, ttl = core.load.lend(session.scoped(lookup_id))
        chunk_size = engine.config.chunk_size
        num_tokens = int_field(header, "digests_of", -1)
        ends = [min((index + 1) * chunk_size, num_tokens) for index in range(len(objs))]
        if not objs or ends[-1] != hits:
            core.load.release(objs)
            return reply
        lent = Transaction(
            self._sessions.next_txn_id(),
            MessageType.RETRIEVE,
            # The copy may begin as the pins expire: the payloads stay as long again as
            # any one request of the client may take.
            txn_deadline(header, engine.config.retrieve_timeout) + ttl,
            [],
            objs,
            lent_for=lookup_id,
            lent_tokens=hits,
        )
        session.transactions[lent.txn_id] = lent
        reply["txn"] = lent.txn_id
        reply["ttl"] = ttl
        reply["chunks"] = [
            [index * chunk_size, end, core.buffer_offset(obj), obj.nbytes]
            for index, (end, obj) in enumerate(zip(ends, objs, strict=True))
        ]
        return reply

    def now(self, session: Session | None, message: Message) -> dict[str, Any] | None:
        """A LOOKUP by chunk digests that the engine answers without waiting (its CPU tier
        suffices); None for any other."""
        assert session is not None
        engine, header = self._host.engine, message.header
        if (
            engine is None
            or "digests_of" not in header
            or "search_range" in header
            or session.commits.count
        ):
            return None
        pin, lookup_id, scoped = pin_fields(session, header)
        if pin and lookup_id is not None:
            session.hold_lookup(lookup_id, self._max_pins)
        hits = engine.lookup_digests_now(
            digests_frame(message, self._max_chunks),
            int_field(header, "digests_of", -1),
            lookup_id=scoped,
            pin=pin,
            tenant=tenant_of(header),
        )
        if hits is None:
            return None
        _forget_empty(session, engine, pin, lookup_id, hits)
        return self._answer(session, engine, header, lookup_id if pin else None, hits)

    def unpin_now(self, session: Session | None, message: Message) -> dict[str, Any] | None:
        """An UNPIN, answered at once: releasing pins never waits."""
        assert session is not None
        engine = self._host.engine
        if engine is None:
            return None
        lookup_id = lookup_id_field(message.header, required=True)
        assert lookup_id is not None
        session.lookup_ids.discard(lookup_id)
        engine.lookup_unpin_now(session.scoped(lookup_id))
        return {}

    async def on_lookup(self, session: Session | None, message: Message) -> Reply:
        assert session is not None
        engine = self._host.need_engine()
        header = message.header
        if flag_field(header, "promise"):
            return await self._promise(session, message)
        pin, lookup_id, scoped = pin_fields(session, header)
        search_range = locations_field(header, "search_range")
        tenant = tenant_of(header)
        if "digests_of" in header:
            # The client hashed the prompt: one frame of DIGEST_SIZE-byte chunk digests.
            num_tokens = int_field(header, "digests_of", -1)
            digests = digests_frame(message, self._max_chunks)
            if pin and lookup_id is not None:
                session.hold_lookup(lookup_id, self._max_pins)
            hits = await engine.lookup_digests(
                digests,
                num_tokens,
                lookup_id=scoped,
                pin=pin,
                search_range=search_range,
                tenant=tenant,
            )
            _forget_empty(session, engine, pin, lookup_id, hits)
            return self._answer(session, engine, header, lookup_id if pin else None, hits), ()
        tokens, hashes, offsets = key_input(message, self._max_chunks)
        if pin and lookup_id is not None:
            session.hold_lookup(lookup_id, self._max_pins)
        hits = await engine.lookup(
            tokens,
            hashes=hashes,
            offsets=offsets,
            lookup_id=scoped,
            pin=pin,
            search_range=search_range,
            tenant=tenant,
        )
        _forget_empty(session, engine, pin, lookup_id, hits)
        return {"hits": hits}, ()

    async def _promise(self, session: Session, message: Message) -> Reply:
        """A LOOKUP with ``"promise": true``: the engine's promise for the session's lookup
        id (``"hits"``, and ``"pending"`` while its prefetch runs)."""
        engine = self._host.need_engine()
        header = message.header
        lookup_id = lookup_id_field(header, required=True)
        assert lookup_id is not None
        tokens, hashes, offsets = key_input(message, self._max_chunks)
        session.hold_lookup(lookup_id, self._max_pins)
        promise = await engine.promise(
            tokens,
            lookup_id=session.scoped(lookup_id),
            hashes=hashes,
            offsets=offsets,
            tenant=tenant_of(header),
            computed_tokens=int_field(header, "computed", 0),
            prefill_tokens_per_s=header.get("prefill_tps"),
            finish=flag_field(header, "finish"),
            wait=check_promise_wait(header.get("wait", 0.0)),
        )
        return {"hits": promise.tokens, "pending": promise.pending}, ()

    async def on_prefetch(self, session: Session | None, message: Message) -> Reply:
        assert session is not None
        engine = self._host.need_engine()
        header = message.header
        lookup_id = lookup_id_field(header, required=True)
        assert lookup_id is not None
        tenant = tenant_of(header)
        tokens, hashes, offsets = key_input(message, self._max_chunks)
        session.hold_lookup(lookup_id, self._max_pins)
        hits = await engine.prefetch(
            tokens,
            lookup_id=session.scoped(lookup_id),
            hashes=hashes,
            offsets=offsets,
            search_range=locations_field(header, "search_range"),
            tenant=tenant,
        )
        return {"hits": hits}, ()

    async def on_unpin(self, session: Session | None, message: Message) -> Reply:
        assert session is not None
        lookup_id = lookup_id_field(message.header, required=True)
        assert lookup_id is not None
        session.lookup_ids.discard(lookup_id)
        await self._host.need_engine().lookup_unpin(session.scoped(lookup_id))
        return {}, ()
