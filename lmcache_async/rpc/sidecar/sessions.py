"""The sidecar's clients: one :class:`Session` per ROUTER identity, the payloads each has
borrowed (:class:`Transaction`) and the lookup pins it holds.

A session lives while its client sends requests or heartbeats; :meth:`Sessions.reap` drops
one silent for the session timeout, and a transaction past its deadline, giving back what
they held. Lookup ids are scoped per session, so two clients' ids never meet.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Final

import anyio

from lmcache_async.core import LoadCore, StoreCore, StoreTxn
from lmcache_async.errors import EngineClosedError, ProtocolError
from lmcache_async.keys.chunks import ChunkSpan
from lmcache_async.logging import get_logger
from lmcache_async.memory.pool import MemoryObj
from lmcache_async.rpc.protocol import Message, MessageType
from lmcache_async.rpc.sidecar.host import EngineHost

__all__ = ["AFTER_COMMITS", "Busy", "InFlight", "Session", "Sessions", "Transaction"]

log = get_logger(__name__)

AFTER_COMMITS: Final = frozenset(
    {MessageType.LOOKUP, MessageType.PREFETCH, MessageType.STORE, MessageType.RETRIEVE}
)
"""A session's requests that wait for the COMMITs it sent before them: what it reads or
stores sees what it committed, whether or not it waited for the commit's reply."""


class Busy(Exception):
    """A refusal for now: the client holds too much (open transactions, pinned lookups) or
    the server is full. Answered ``busy``: the client may retry once it has let go."""


class InFlight:
    """Requests of one kind read from a session's socket and not yet served: counted in
    the socket's reader callback (before any later message is read), waited for by the
    session's later requests that must come after them."""

    __slots__ = ("_done", "count")

    def __init__(self) -> None:
        self.count = 0
        self._done: anyio.Event | None = None

    def read(self) -> None:
        """One was read."""
        self.count += 1

    def served(self, _task: object = None) -> None:
        """One read earlier has been served or has failed (its task, ignored)."""
        self.count -= 1
        if not self.count and self._done is not None:
            self._done.set()
            self._done = None

    async def settled(self, timeout: float) -> None:
        """Wait (at most ``timeout`` seconds) until every one read so far is served."""
        if not self.count:
            return
        if self._done is None:
            self._done = anyio.Event()
        with anyio.move_on_after(timeout):
            await self._done.wait()


@dataclass(eq=False, slots=True)
class Transaction:
    """Payloads lent to one client between a STORE and its COMMIT, or a RETRIEVE (or a
    pinned LOOKUP that lends its hit) and its RELEASE: ``objs`` are the payloads of
    ``spans``, one reference each. A store's ``store`` is its transaction with the
    engine's request core, which takes the payloads back (:meth:`release`) when the
    client never commits."""

    txn_id: int
    kind: MessageType
    deadline: float
    spans: list[ChunkSpan]
    objs: list[MemoryObj] = field(default_factory=list)
    store: StoreTxn | None = None
    store_core: StoreCore | None = None
    lent_for: int | str | None = None
    """A lookup's lent payloads (:meth:`LoadCore.lend`): the client's lookup id they
    were pinned under. They are chunks of the CPU tier, not memory taken for the client."""
    lent_tokens: int = 0
    """The tokens a lookup's lent payloads cover (a lend has no ``spans``)."""

    def tokens(self) -> int:
        """The tokens the transaction lends."""
        if self.lent_for is not None:
            return self.lent_tokens
        return sum(span.end - span.start for span in self.spans)

    def release(self) -> None:
        """Give every payload back: a store is aborted with the core, a load's
        references are dropped."""
        if self.store is not None and self.store_core is not None:
            self.store_core.abort(self.store, self.objs)
        else:
            LoadCore.release(self.objs)
        self.objs.clear()


@dataclass(eq=False, slots=True)
class Session:
    """One connected client (one ROUTER identity)."""

    identity: bytes
    label: str
    last_seen: float
    owner: str = ""
    """The z85 public key of the peer that opened it (empty without CURVE): no other
    peer may use it, even one that takes over its ROUTER identity."""
    transactions: dict[int, Transaction] = field(default_factory=dict)
    lookup_ids: set[int | str] = field(default_factory=set)
    commits: InFlight = field(default_factory=InFlight)
    """COMMITs read and not yet served: the session's later data requests wait for them
    (:data:`AFTER_COMMITS`), so a client that does not wait for a commit's reply still
    finds what it stored."""
    lookups: InFlight = field(default_factory=InFlight)
    """LOOKUPs read and served in a task, not yet answered: a STORE sent ahead
    (``"ahead"``) waits for them, so its reservation evicts nothing they would pin."""
    read_aheads: dict[Hashable, Hashable] = field(default_factory=dict)
    """Streamed loads' next parts read ahead (:mod:`~.read_ahead`): the first chunk key of
    the part, and the engine-side id the reading is pinned under."""

    def hold_lookup(self, lookup_id: int | str, limit: int) -> None:
        """Record that this session pins under ``lookup_id`` (before it pins).

        Raises:
            Busy: a new id past ``limit`` ids held.
        """
        ids = self.lookup_ids
        if lookup_id not in ids:
            if len(ids) >= limit:
                raise Busy(f"this session holds pins under {len(ids)} lookup ids: unpin some")
            ids.add(lookup_id)

    def held_bytes(self, page_size: int) -> int:
        """Bytes of pool memory (whole pages of ``page_size``) lent to this session's open
        transactions."""
        return page_size * sum(
            -(-obj.nbytes // page_size)
            for txn in self.transactions.values()
            if txn.lent_for is None
            for obj in txn.objs
        )

    def check_room(self, limit: int) -> None:
        """Raises Busy when this session holds ``limit`` open transactions already (its
        lookups' lends aside: they are bounded apart, :meth:`lends`)."""
        held = len(self.transactions) - self.lends()
        if held >= limit:
            raise Busy(f"this session holds {held} open transactions: commit or release them first")

    def lends(self) -> int:
        """The session's open transactions that are pinned lookups' lends."""
        return sum(txn.lent_for is not None for txn in self.transactions.values())

    def scoped(self, lookup_id: int | str) -> tuple[str, bytes, int | str]:
        """The engine-side lookup id: a client's ids never meet another client's."""
        return ("sidecar", self.identity, lookup_id)

    def take(self, message: Message, kind: MessageType) -> Transaction | None:
        """End this session's transaction named in the message (None: it expired).

        Raises:
            ProtocolError: the message's ``txn`` is not an int.
        """
        txn_id = message.header.get("txn")
        if not isinstance(txn_id, int) or isinstance(txn_id, bool):
            raise ProtocolError("'txn' must be an int")
        txn = self.transactions.get(txn_id)
        if txn is None or txn.kind is not kind:
            log.warning("sidecar_transaction_unknown", client=self.label, kind=kind.name)
            return None
        del self.transactions[txn_id]
        return txn


class Sessions:
    """Every session, by identity (``by_identity``, read by the socket's reader callback
    for every message), and the transaction ids they draw from."""

    def __init__(self, host: EngineHost, *, timeout: float, heartbeat_interval: float) -> None:
        self._host = host
        self._timeout = timeout
        self._period = min(heartbeat_interval, timeout) / 2
        self.by_identity: dict[bytes, Session] = {}
        self._txn_ids = itertools.count(1)

    def add(self, session: Session) -> None:
        """Keep ``session`` (a client said HELLO)."""
        self.by_identity[session.identity] = session

    def next_txn_id(self) -> int:
        return next(self._txn_ids)

    def __len__(self) -> int:
        return len(self.by_identity)

    def transactions(self) -> int:
        """Transactions open across all sessions."""
        return sum(len(s.transactions) for s in self.by_identity.values())

    def lookup_ids(self) -> int:
        """Lookup ids held across all sessions."""
        return sum(len(s.lookup_ids) for s in self.by_identity.values())

    async def end_all(self, reason: str) -> None:
        """Drop every session."""
        for session in list(self.by_identity.values()):
            await self.drop(session, reason)

    async def drop(self, session: Session, reason: str) -> None:
        """Forget a client: end its transactions and release its lookup pins."""
        self.by_identity.pop(session.identity, None)
        for txn in session.transactions.values():
            txn.release()
        engine = self._host.engine
        if engine is not None:
            for lookup_id in session.lookup_ids:
                with contextlib.suppress(EngineClosedError):
                    await engine.lookup_unpin(session.scoped(lookup_id))
            for ahead in session.read_aheads.values():
                engine.core.load.drop_prefetch(ahead)
        session.read_aheads.clear()
        log.info(
            "sidecar_session_dropped",
            client=session.label,
            reason=reason,
            transactions=len(session.transactions),
            lookup_ids=len(session.lookup_ids),
        )
        session.transactions.clear()
        session.lookup_ids.clear()

    async def reap(self) -> None:
        """Drop sessions silent for the session timeout and transactions past their
        deadline, checking twice per heartbeat interval, until cancelled."""
        while True:
            await anyio.sleep(self._period)
            now = time.monotonic()
            for session in list(self.by_identity.values()):
                if now - session.last_seen > self._timeout:
                    await self.drop(session, "timeout")
                    continue
                for txn_id, txn in list(session.transactions.items()):
                    if txn.deadline <= now:
                        del session.transactions[txn_id]
                        txn.release()
                        log.warning("sidecar_transaction_expired", client=session.label)
