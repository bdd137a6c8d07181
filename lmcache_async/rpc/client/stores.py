"""A client's stores: STORE (the sidecar's request core decides what is stored and lends
the chunks it reserved), the copies into them, then COMMIT, not waited for when the
sidecar says it cannot keep fewer than it was given (``"promised"``). A store of a prompt
whose STORE a pinned lookup sent ahead (:mod:`~.ahead`) takes that reply instead of
asking.
"""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import torch

from lmcache_async.errors import ProtocolError
from lmcache_async.keys.tokens import Tokens
from lmcache_async.logging import get_logger
from lmcache_async.rpc.client.ahead import Ahead, StoresAhead
from lmcache_async.rpc.client.connection import Connection
from lmcache_async.rpc.client.copies import CopyPath, Prepared
from lmcache_async.rpc.client.link import Link
from lmcache_async.rpc.client.welcome import check_tiers
from lmcache_async.rpc.client.wire import Unavailable, chunk_digests, count, key_fields
from lmcache_async.rpc.protocol import Message, MessageType, put_tenant

__all__ = ["Stores"]

log = get_logger(__name__)


class Stores:
    """Stores over ``conn``, copied by ``copies``; stores sent ahead are in ``ahead``."""

    def __init__(self, conn: Connection, copies: CopyPath, ahead: StoresAhead) -> None:
        self._conn = conn
        self._copies = copies
        self._ahead = ahead

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
            since = 0  # the token the reply counts from (0 for a STORE sent ahead)
            reply = None
            plain = tokens is not None and hashes is None and locations is None
            if self._ahead and plain and skipped is None:
                assert tokens is not None
                reply = await self._reply_ahead(link, tokens, tenant, prepared)
                since = 0 if reply is None else prepared.start
            if reply is None:
                reply = await conn.ask(link, MessageType.STORE, header, prepared.payloads)
            stored = await self._fill(link, prepared, reply, deadline)
            return max(0, stored - since)  # 0: nothing stored (a store given up)
        except (Unavailable, ProtocolError) as exc:
            log.debug("sidecar_store_missed", error=str(exc))
            return 0

    async def _fill(self, link: Link, prepared: Prepared, reply: Message, deadline: float) -> int:
        """Copy into the chunks a STORE reply lent and commit them, by ``deadline``; the
        tokens stored as the reply counts them. A commit that cannot keep fewer
        (``"promised"``) is not waited for: the session's next requests wait for it on
        the sidecar.

        Raises:
            Unavailable, ProtocolError: the store could not be made.
        """
        conn = self._conn
        if "stored" in reply.header:
            return count(reply, "stored")
        txn = reply.header.get("txn")
        try:
            chunks = self._copies.chunks(reply, prepared)
            payloads = await self._copies.gather(link, prepared, chunks)
        except BaseException:
            abort = {"txn": txn, "abort": True}
            await link.notify(MessageType.COMMIT, abort, conn.timeout)
            raise
        left = deadline - anyio.current_time()
        if left <= 0:
            abort = {"txn": txn, "abort": True}
            await link.notify(MessageType.COMMIT, abort, conn.timeout)
            return 0
        promised = reply.header.get("promised")
        if (
            not payloads
            and isinstance(promised, int)
            and not isinstance(promised, bool)
            and 0 <= promised <= prepared.num_tokens
        ):
            quiet = {"txn": txn, "quiet": True}
            link.notify_soon(MessageType.COMMIT, quiet, conn.timeout)
            return 0 if link.dead else promised
        reply = await conn.ask(link, MessageType.COMMIT, {"txn": txn}, payloads, timeout=left)
        return count(reply, "stored")

    # -- stores sent ahead ----------------------------------------------------------------

    def send_ahead(self, tokens: Tokens, digests: bytes, tenant: str | None) -> None:
        """Send the STORE of a prompt a pinned lookup was just sent for, from its first
        token on, not waiting for its reply, and remember it for the store of the same
        prompt (:mod:`~.ahead`). The sidecar serves it after the lookup (``"ahead"``)."""
        conn = self._conn
        link = conn.link
        if link is None or link.dead:
            return
        header, payloads, num_tokens = key_fields(tokens, None, None)
        put_tenant(header, tenant)
        header.update(start=0, limit=num_tokens, timeout=conn.timeout, ahead=True)
        sent = conn.send_ahead(link, MessageType.STORE, header, payloads)
        if sent is not None:
            # Used by a store within half the time the sidecar holds it: its copies may
            # take the client's timeout.
            until = anyio.current_time() + conn.timeout / 2
            self._ahead.add((header.get("tenant"), digests), Ahead(link, sent, num_tokens, until))

    def forget_ahead(self, digests: bytes, tenant: str | None) -> None:
        """Give back the STORE sent ahead for a prompt whose lookup did not count (its
        tokens changed while it was under way)."""
        header: dict[str, object] = {}
        put_tenant(header, tenant)
        ahead = self._ahead.take((header.get("tenant"), digests))
        if ahead is not None:
            ahead.link.forget(ahead.sent)

    async def _reply_ahead(
        self, link: Link, tokens: Tokens, tenant: str | None, prepared: Prepared
    ) -> Message | None:
        """The reply to the STORE sent ahead for this store's prompt, when there is one it
        may use: sent on this link, in time, and lending no chunk before the store's
        first token (or counting it stored); None, having given any other back."""
        conn = self._conn
        hasher = conn.hasher if tenant is None else conn.hasher_for(tenant)
        if hasher is None:
            return None
        digests = await chunk_digests(hasher, tokens)
        ahead = self._ahead.take((prepared.header.get("tenant"), b"".join(digests)))
        if ahead is None:
            return None
        if (
            ahead.link is not link
            or ahead.num_tokens != prepared.num_tokens
            or anyio.current_time() > ahead.usable_until
        ):
            ahead.link.forget(ahead.sent)
            return None
        try:
            reply = await link.reply(ahead.sent)
        except (Unavailable, ProtocolError):
            return None
        if "stored" in reply.header:
            return reply if count(reply, "stored") >= prepared.start else None
        try:
            self._copies.chunks(reply, prepared)
        except ProtocolError:  # a chunk before the store's first token: not this store's
            abort = {"txn": reply.header.get("txn"), "abort": True}
            await link.notify(MessageType.COMMIT, abort, conn.timeout)
            return None
        return reply
