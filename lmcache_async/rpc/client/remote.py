""":class:`RemoteCacheEngine`: a sidecar's cache behind the async engine interface.

The engine is a front over parts with one concern each, passed the connection they share:
:class:`~.connection.Connection` (the link, hellos, heartbeats, reconnects; built from the
checked :class:`~.settings.ClientSettings`),
:class:`~.transfers.DataPath` (store and retrieve with their KV copies),
:class:`~.lookups.Lookups`, :class:`~.admin.AdminCalls` and :class:`~.moves.Moves`.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from types import TracebackType
from typing import Any

import anyio
import torch
from anyio.abc import TaskGroup

from lmcache_async.config import DEFAULT_INLINE_COPY_BYTES
from lmcache_async.engine.client import Promise, check_promise_wait
from lmcache_async.errors import InvalidInputError
from lmcache_async.keys.tokens import Tokens
from lmcache_async.layouts import KVCacheViews, KVLayout
from lmcache_async.rpc.client.admin import AdminCalls
from lmcache_async.rpc.client.ahead import StoresAhead
from lmcache_async.rpc.client.connection import Connection
from lmcache_async.rpc.client.lends import Lends
from lmcache_async.rpc.client.lookups import Lookups
from lmcache_async.rpc.client.move_calls import MoveCalls
from lmcache_async.rpc.client.moves import Moves
from lmcache_async.rpc.client.settings import (
    DEFAULT_CLIENT_LIMITS,
    DEFAULT_RECONNECT_INTERVAL,
    DEFAULT_TIMEOUT,
    ClientSettings,
)
from lmcache_async.rpc.client.state import ConnectionState
from lmcache_async.rpc.client.transfers import DataPath
from lmcache_async.rpc.client.welcome import check_tiers
from lmcache_async.rpc.client.wire import check_lookup_id, key_fields
from lmcache_async.rpc.protocol import MessageLimits, MessageType, put_tenant
from lmcache_async.transfer.cuda import Transfers

__all__ = ["RemoteCacheEngine"]


class RemoteCacheEngine(MoveCalls, ConnectionState):
    """A sidecar's cache, behind the async interface of
    :class:`~lmcache_async.CacheEngine` (store, retrieve, lookup, lookup_unpin, prefetch,
    clear, freeze, set_hot_cache, stats, move, is_healthy, aclose).

    Create it with :meth:`connect`. :meth:`push_chunks` is the receiving half of a move
    (payloads with their checksums, verified by the sidecar). ``freeze``,
    ``set_hot_cache`` and ``stats`` are coroutines here (they ask the server).
    ``store_layer``/``retrieve_layer``, ``flush`` and KV events are not offered over the
    sidecar. Lookups by tokens send the prompt's chunk digests (the server says how it
    hashes in its welcome), not the tokens. Every request about a prompt takes
    ``tenant=`` (None: the ``tenant`` given here), as the engine's do.
    """

    def __init__(
        self,
        url: str,
        layout: KVLayout,
        *,
        model_name: str,
        revision: str | None = None,
        tenant: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        server_public_key: bytes | str | None = None,
        client_certificate: str | tuple[bytes, bytes] | None = None,
        shared_memory: bool | None = None,
        reconnect_interval: float = DEFAULT_RECONNECT_INTERVAL,
        name: str | None = None,
        limits: MessageLimits = DEFAULT_CLIENT_LIMITS,
        store_ahead: bool = False,
        stream: bool = True,
    ) -> None:
        settings = ClientSettings(
            url=url,
            layout=layout,
            model_name=model_name,
            revision=revision,
            tenant=tenant,
            timeout=timeout,
            server_public_key=server_public_key,
            client_certificate=client_certificate,
            shared_memory=shared_memory,
            stream=stream,
            reconnect_interval=reconnect_interval,
            name=name,
            limits=limits,
        )
        if not isinstance(store_ahead, bool):
            raise InvalidInputError(f"store_ahead must be a bool, got {store_ahead!r:.40}")
        self.url = url
        self.layout = layout
        self._store_ahead = store_ahead
        self._conn = Connection(settings)
        self._lends = Lends(self._conn.timeout)
        self._ahead = StoresAhead()
        # The payloads are the server's shared memory or local buffers, never pinned:
        # CUDA copies are queued off the event loop.
        self._transfers = Transfers(inline_bytes=DEFAULT_INLINE_COPY_BYTES, host_pinned=False)
        self._data = DataPath(
            self._conn,
            layout,
            KVCacheViews(layout),  # the serving engine's caches, checked once
            self._transfers,
            lends=self._lends,
            ahead=self._ahead,
        )
        self._lookups = Lookups(self._conn, self._lends)
        self._admin = AdminCalls(self._conn)
        self._moves = Moves(self._conn)

    # -- lifecycle ------------------------------------------------------------------------

    @classmethod
    def connect(
        cls,
        url: str,
        layout: KVLayout,
        *,
        model_name: str,
        revision: str | None = None,
        tenant: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        server_public_key: bytes | str | None = None,
        client_certificate: str | tuple[bytes, bytes] | None = None,
        shared_memory: bool | None = None,
        require_server: bool = True,
        reconnect_interval: float = DEFAULT_RECONNECT_INTERVAL,
        name: str | None = None,
        store_ahead: bool = False,
        stream: bool = True,
    ) -> _RemoteContext:
        """An async context manager: say hello to the sidecar at ``url``, yield the client,
        close it on exit.

        ``model_name``, ``revision``, ``tenant`` and ``layout`` name the namespace; the
        first client fixes it for the sidecar. ``server_public_key`` (z85) is needed for a
        sidecar started with a CURVE secret key, and ``client_certificate``: the path of
        this client's ``zmq.auth`` secret certificate, whose public half is on the sidecar's
        allow-list (or its (public, secret) z85 key pair). ``shared_memory``: None uses the
        server's segment when it is on this host, False always sends payloads inline, True
        requires the segment. With ``require_server=False`` an unreachable sidecar is not an
        error: calls are misses until it answers. ``store_ahead``: for a serving engine
        that stores each prompt after its pinned lookup (and retrieve): such a lookup is
        sent with the prompt's STORE right behind it, so the sidecar reserves its
        missing chunks while the engine computes them and the store waits for no round
        trip (:mod:`~lmcache_async.rpc.client.ahead`). A client that does not
        store after its pinned lookups would hold that memory until it expires.
        ``stream``: reach an ``ipc://`` sidecar over its same-host stream socket when it
        listens on one (:mod:`~lmcache_async.rpc.stream`: no ZeroMQ I/O threads on the
        request path); False: always ZeroMQ.

        Raises:
            InvalidInputError: a bad argument, or the sidecar serves another namespace
                (the message names the difference).
            ConfigError: ``field="client_certificate"``: the certificate cannot be used.
            ProtocolError: the sidecar speaks another protocol version.
            TierUnavailableError: with ``require_server``, no answer within ``timeout``
                (a sidecar with CURVE keys does not answer a client without its key).
        """
        engine = cls(
            url,
            layout,
            model_name=model_name,
            revision=revision,
            tenant=tenant,
            timeout=timeout,
            server_public_key=server_public_key,
            client_certificate=client_certificate,
            shared_memory=shared_memory,
            reconnect_interval=reconnect_interval,
            name=name,
            store_ahead=store_ahead,
            stream=stream,
        )
        return _RemoteContext(engine, require_server)

    async def _start(self, task_group: TaskGroup, require_server: bool) -> None:
        await self._conn.start(task_group, require_server)
        self._transfers.start_threads()  # not waited for: the first copy finds them up

    async def aclose(self) -> None:
        """Close the socket, unmap the segment and stop the copy threads; idempotent.
        Later calls raise EngineClosedError."""
        if self._conn.closed:
            return
        self._lends.release_all()
        self._ahead.forget_all()
        self._conn.close()
        await self._data.aclose()
        self._conn.term()

    @property
    def closed(self) -> bool:
        return self._conn.closed

    # -- requests -------------------------------------------------------------------------

    async def store(
        self,
        tokens: Tokens | None = None,
        *,
        kv_caches: Sequence[torch.Tensor],
        slot_mapping: torch.Tensor,
        mask: torch.Tensor | None = None,
        req_id: str | None = None,
        hashes: Sequence[int | bytes] | None = None,
        offsets: Sequence[int] | None = None,
        store_location: Sequence[str] | None = None,
        stream: torch.cuda.Stream | None = None,
        tenant: str | None = None,
    ) -> int:
        """As :meth:`CacheEngine.store <lmcache_async.CacheEngine.store>`: copy the KV of
        ``tokens`` into the sidecar's cache; returns the tokens cached from the first
        stored chunk on, 0 when the sidecar is unreachable or too slow. ``stream``: the
        CUDA stream the KV was written on (as for CacheEngine; ignored on the CPU).
        ``tenant``: whose KV this is (default: this client's ``tenant``); only requests of
        the same tenant find it.

        Raises:
            InvalidInputError: bad input (nothing stored).
            EngineClosedError: the client is closed.
        """
        return await self._data.stores.store(
            tokens,
            kv_caches=kv_caches,
            slot_mapping=slot_mapping,
            mask=mask,
            req_id=req_id,
            hashes=hashes,
            offsets=offsets,
            store_location=store_location,
            stream=stream,
            tenant=tenant,
        )

    async def retrieve(
        self,
        tokens: Tokens | None = None,
        *,
        kv_caches: Sequence[torch.Tensor],
        slot_mapping: torch.Tensor,
        mask: torch.Tensor | None = None,
        req_id: str | None = None,
        lookup_id: Hashable | None = None,
        hashes: Sequence[int | bytes] | None = None,
        offsets: Sequence[int] | None = None,
        retrieve_locations: Sequence[str] | None = None,
        stream: torch.cuda.Stream | None = None,
        tenant: str | None = None,
    ) -> torch.Tensor:
        """As :meth:`CacheEngine.retrieve <lmcache_async.CacheEngine.retrieve>`: load the
        cached run of chunks from the mask start on into ``kv_caches``; returns the bool CPU
        mask of the tokens written (all False when the sidecar is unreachable). ``stream``:
        the CUDA stream the KV is read on (as for CacheEngine; ignored on the CPU).
        ``tenant``: whose KV is asked for (as :meth:`store`).

        Raises:
            InvalidInputError: bad input.
            EngineClosedError: the client is closed.
        """
        return await self._data.loads.retrieve(
            tokens,
            kv_caches=kv_caches,
            slot_mapping=slot_mapping,
            mask=mask,
            req_id=req_id,
            lookup_id=lookup_id,
            hashes=hashes,
            offsets=offsets,
            retrieve_locations=retrieve_locations,
            stream=stream,
            tenant=tenant,
        )

    async def lookup(
        self,
        tokens: Tokens | None = None,
        *,
        lookup_id: Hashable | None = None,
        pin: bool = False,
        hashes: Sequence[int | bytes] | None = None,
        offsets: Sequence[int] | None = None,
        search_range: Sequence[str] | None = None,
        tenant: str | None = None,
    ) -> int:
        """As :meth:`CacheEngine.lookup <lmcache_async.CacheEngine.lookup>`: prefix tokens
        cached in the sidecar for ``tenant`` (default: this client's; 0 when it is
        unreachable). Pins (``pin=True`` with a ``lookup_id``: an int or str) belong to
        this client and are released by :meth:`lookup_unpin`, a retrieve with the id, or
        when this client goes away.

        Raises:
            InvalidInputError: bad input.
            EngineClosedError: the client is closed.
        """
        # The options are checked here, the request made by Lookups (by digests when the
        # server's hasher is known).
        conn = self._conn
        conn.check_open()
        if not isinstance(pin, bool):
            raise InvalidInputError(f"pin must be a bool, got {type(pin).__name__}")
        if pin and lookup_id is None:
            raise InvalidInputError("pin=True needs a lookup_id")
        options: dict[str, Any] = {"pin": pin}
        if lookup_id is not None:
            options["lookup_id"] = check_lookup_id(lookup_id)
        locations = check_tiers(conn.welcome, search_range, "search_range")
        if locations is not None:
            options["search_range"] = locations
        put_tenant(options, tenant)
        lookups = self._lookups
        hasher = conn.hasher if tenant is None else conn.hasher_for(tenant)
        if hasher is None or tokens is None or hashes is not None or offsets is not None:
            header, key_payloads, num_tokens = key_fields(tokens, hashes, offsets)
            header.update(options)
            return await lookups.hits(MessageType.LOOKUP, header, key_payloads, num_tokens) or 0
        stores = self._data.stores if self._store_ahead and pin else None
        return await lookups.by_digests(hasher, tokens, options, tenant, stores)

    async def prefetch(
        self,
        tokens: Tokens | None = None,
        *,
        lookup_id: Hashable,
        hashes: Sequence[int | bytes] | None = None,
        offsets: Sequence[int] | None = None,
        search_range: Sequence[str] | None = None,
        tenant: str | None = None,
    ) -> int:
        """As :meth:`CacheEngine.prefetch <lmcache_async.CacheEngine.prefetch>`: look up
        (for ``tenant``, as :meth:`lookup`) and start loading the hits from disk or Redis
        into the sidecar's memory, for a later :meth:`retrieve` with the same
        ``lookup_id`` (0 when unreachable).

        Raises:
            InvalidInputError: bad input.
            EngineClosedError: the client is closed.
        """
        return await self._lookups.prefetch(
            tokens,
            lookup_id=lookup_id,
            hashes=hashes,
            offsets=offsets,
            search_range=search_range,
            tenant=tenant,
        )

    async def promise(
        self,
        tokens: Tokens | None = None,
        *,
        lookup_id: Hashable,
        hashes: Sequence[int | bytes] | None = None,
        offsets: Sequence[int] | None = None,
        tenant: str | None = None,
        computed_tokens: int = 0,
        prefill_tokens_per_s: float | None = None,
        finish: bool = False,
        wait: float = 0.0,
    ) -> Promise:
        """As :meth:`CacheEngine.promise <lmcache_async.CacheEngine.promise>`, of the
        sidecar's engine: only chunks verified in the sidecar's memory are promised, pinned
        for this client's ``lookup_id`` (nothing when the sidecar cannot be reached).

        Raises:
            InvalidInputError: bad input.
            EngineClosedError: the client is closed.
        """
        options: dict[str, Any] = {"computed": computed_tokens, "finish": bool(finish)}
        if prefill_tokens_per_s is not None:
            options["prefill_tps"] = prefill_tokens_per_s
        if check_promise_wait(wait):
            options["wait"] = min(wait, self._conn.timeout / 2)  # answered within its wait
        return await self._lookups.promise(
            tokens,
            lookup_id=lookup_id,
            hashes=hashes,
            offsets=offsets,
            tenant=tenant,
            options=options,
        )

    async def lookup_unpin(self, lookup_id: Hashable) -> None:
        """Release this client's pins for ``lookup_id`` (logged when it fails)."""
        await self._lookups.unpin(lookup_id)

    # -- administration -------------------------------------------------------------------

    async def clear(self, locations: Sequence[str] | None = None) -> int:
        """Drop every cached chunk of the named tiers (default: all) in the sidecar;
        returns how many chunks were dropped (0 when unreachable)."""
        return await self._admin.clear(locations)

    async def erase(self, tenant: str | None = None) -> dict[str, int]:
        """As ``CacheEngine.erase``, in the sidecar; TierUnavailableError when unreachable."""
        return await self._admin.erase(tenant)

    async def freeze(self, enabled: bool) -> bool:
        """Switch the sidecar's freeze mode; False when it could not be reached."""
        return await self._admin.switch(MessageType.FREEZE, enabled)

    async def set_hot_cache(self, enabled: bool) -> bool:
        """Switch the sidecar's CPU hot cache; False when it could not be reached."""
        return await self._admin.switch(MessageType.HOT_CACHE, enabled)

    async def stats(self) -> dict[str, Any]:
        """The sidecar engine's stats (``"engine"``: the fields of
        :class:`~lmcache_async.EngineStats` as plain data, None when unreachable), the
        server's own state (``"server"``: sessions, transactions, segment) and this client's
        counters (``"client"``)."""
        return await self._admin.stats()

    async def ping(self) -> bool:
        """One empty round trip to the sidecar: True when it answered within the timeout."""
        return await self._admin.ping()


class _RemoteContext:
    """What :meth:`RemoteCacheEngine.connect` returns: ``async with`` yields the client."""

    def __init__(self, engine: RemoteCacheEngine, require_server: bool) -> None:
        self._engine = engine
        self._require_server = require_server
        self._task_group: TaskGroup | None = None

    async def __aenter__(self) -> RemoteCacheEngine:
        task_group = anyio.create_task_group()
        await task_group.__aenter__()
        self._task_group = task_group
        try:
            await self._engine._start(task_group, self._require_server)
        except BaseException:
            await self._close()
            raise
        return self._engine

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._close()

    async def _close(self) -> None:
        """Close the client, then leave the task group: its tasks (the keeper, the receive
        loops) end through their own cancel scopes, so an exception from the ``async with``
        body passes through as it is, not wrapped in an exception group."""
        try:
            await self._engine.aclose()
        finally:
            assert self._task_group is not None
            await self._task_group.__aexit__(None, None, None)
