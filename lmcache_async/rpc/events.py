"""KV events over ZeroMQ, in vLLM's wire format: what a KV-aware router learns about a
cache's contents.

An :class:`EventPublisher` binds an XPUB socket and publishes the events an engine records
(chunks stored into or removed from a tier, every tier cleared) as vLLM's engines publish
theirs (:mod:`~lmcache_async.rpc.kv_wire`): ``[topic, 8-byte big-endian sequence number,
msgpack KVEventBatch]``, one batch per wake-up, blocks of the serving engine's block size.
With a replay address it also binds a ROUTER socket as vLLM's ``replay_endpoint`` does: a
subscriber that saw a gap sends ``[b"", start sequence (8 bytes)]`` and gets every batch it
still holds from there, then ``[b"", -1 (8 bytes), b""]``. The batches kept for replay are
bounded in number and in bytes.

The publisher wakes when the engine records an event (no polling). A slow or stuck
subscriber never slows the engine: PUB sockets drop messages for a subscriber whose queue
(``SNDHWM``) is full, and the engine's own buffer is bounded too.

Events name blocks by hashes of their chunks' keys and carry the prompt's tokens, so they
are as private as the prompts. A publisher given the sidecar's CURVE secret key serves only
subscribers the sidecar's allow-list admits (the ZAP handler of the shared context
decides), and by default it withholds every event of a *named* tenant (chunks whose key tag
is not the unnamed tenant's): ``tenant_events=True`` publishes them too, and a subscriber
then learns those tenants' prompts (never their names). The receiving side is
:mod:`lmcache_async.rpc.event_subscriber` (``lmcache-async events``).
"""

from __future__ import annotations

import collections
import contextlib
import os
import time
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, Protocol

import anyio
import zmq
import zmq.asyncio

from lmcache_async.errors import ConfigError, InvalidInputError
from lmcache_async.events import KVEvent
from lmcache_async.keys.tokens import is_strict_int
from lmcache_async.logging import get_logger
from lmcache_async.rpc.kv_wire import WireEvent, encode_batch, wire_events
from lmcache_async.rpc.transport import check_listen_url
from lmcache_async.tenancy.tenants import TAG_BYTES, tenant_tag

if TYPE_CHECKING:  # a subscriber needs no engine
    from lmcache_async.engine import CacheEngine

__all__ = [
    "DEFAULT_EVENT_SNDHWM",
    "DEFAULT_EVENT_TOPIC",
    "DEFAULT_REPLAY_BATCHES",
    "DEFAULT_REPLAY_BYTES",
    "END_OF_REPLAY",
    "EventPublisher",
    "EventSource",
    "engine_event_source",
    "is_public",
]

log = get_logger(__name__)

DEFAULT_EVENT_TOPIC: Final = b""
"""The topic frame of every batch: empty, as vLLM's publisher sends by default."""
DEFAULT_EVENT_SNDHWM: Final = 10_000
"""Messages queued per subscriber before the socket drops further ones for it."""
DEFAULT_REPLAY_BATCHES: Final = 10_000
"""Batches kept for replay (vLLM's ``buffer_steps``)."""
DEFAULT_REPLAY_BYTES: Final = 64 << 20
"""Bytes of batches kept for replay; the oldest go first past either bound."""
END_OF_REPLAY: Final = (-1).to_bytes(8, "big", signed=True)
"""The sequence frame that ends a replay."""

_SUBSCRIBE: Final = 1
_UNSUBSCRIBE: Final = 0


class EventSource(Protocol):
    """Where a publisher reads events: an open engine (:func:`engine_event_source`), or
    anything with the same members."""

    block_size: int
    """Tokens per block of the serving engine (the blocks the events name)."""
    chunk_size: int
    """Tokens per chunk of the events recorded (a multiple of ``block_size``)."""

    @property
    def events_dropped(self) -> int:
        """Events the source dropped unread so far (it never decreases)."""
        ...

    def take_events(self) -> list[KVEvent]:
        """Return and forget the events recorded so far, oldest first."""
        ...

    async def wait_events(self) -> None:
        """Return once at least one event is recorded."""
        ...


class _EngineEvents:
    """An :class:`EventSource` over an open engine's event buffer."""

    def __init__(self, engine: CacheEngine) -> None:
        self._engine = engine
        self.chunk_size = engine.config.chunk_size
        block = engine.layout.block_size
        # Blocks that do not divide the chunks are announced as whole chunks.
        self.block_size = block if self.chunk_size % block == 0 else self.chunk_size

    @property
    def events_dropped(self) -> int:
        return self._engine.events_dropped

    def take_events(self) -> list[KVEvent]:
        return self._engine.take_events()

    async def wait_events(self) -> None:
        await self._engine.wait_events()


def engine_event_source(engine: CacheEngine) -> EventSource:
    """The events ``engine`` records, as an :class:`EventSource` for a publisher."""
    return _EngineEvents(engine)


def _check_bind_url(url: str, allow_remote: bool, field: str) -> str:
    """A publisher's bind address, checked as a sidecar's listen address is.

    Raises:
        ConfigError: ``field`` naming what is wrong.
    """
    try:
        return check_listen_url(url, allow_remote=allow_remote)
    except ConfigError as exc:
        message = str(exc).removeprefix("listen: ")
        raise ConfigError(field, message) from None


class EventPublisher:
    """Publishes an :class:`EventSource`'s events on a bound XPUB socket, in vLLM's wire
    format (and serves replays on ``replay``, a ROUTER, when given).

    The sockets bind at construction, so subscribers may connect before the engine
    exists; :meth:`run` then publishes one source's events until cancelled. An XPUB socket
    (a PUB that also reports subscriptions) lets :attr:`subscribers` and
    :meth:`wait_subscribed` say whether anyone listens. Use as a context manager or call
    :meth:`close`.

    Raises (constructor):
        ConfigError: ``field="events"`` (``"events_replay"``): the URL is not
            ``ipc://PATH`` or ``tcp://HOST:PORT``, binds beyond loopback without
            ``allow_remote``, or cannot be bound.
        InvalidInputError: ``topic`` is not bytes, or a count or size is not positive.
    """

    def __init__(
        self,
        url: str,
        *,
        topic: bytes = DEFAULT_EVENT_TOPIC,
        replay: str | None = None,
        sndhwm: int = DEFAULT_EVENT_SNDHWM,
        replay_batches: int = DEFAULT_REPLAY_BATCHES,
        replay_bytes: int = DEFAULT_REPLAY_BYTES,
        allow_remote: bool = False,
        context: zmq.asyncio.Context | None = None,
        curve_secret_key: bytes | None = None,
        tenant_events: bool = False,
    ) -> None:
        if not isinstance(topic, bytes):
            raise InvalidInputError("topic must be bytes")
        for name, value in (
            ("sndhwm", sndhwm),
            ("replay_batches", replay_batches),
            ("replay_bytes", replay_bytes),
        ):
            if not is_strict_int(value) or value < 1:
                raise InvalidInputError(f"{name} must be a positive int, got {value!r}")
        _check_bind_url(url, allow_remote, "events")
        if replay is not None:
            _check_bind_url(replay, allow_remote, "events_replay")
        self.topic = topic
        self._own_context = context is None
        self._context = zmq.asyncio.Context() if context is None else context
        self._replay: zmq.asyncio.Socket | None = None
        self._socket = self._context.socket(zmq.XPUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, sndhwm)
        self._socket.setsockopt(zmq.XPUB_VERBOSER, 1)  # every (un)subscription, to count them
        self._bind(self._socket, url, curve_secret_key, "events")
        if replay is not None:
            self._replay = self._context.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._bind(self._replay, replay, curve_secret_key, "events_replay")
        self.endpoint: str = _last_endpoint(self._socket, url)
        self.replay_endpoint: str | None = None
        if self._replay is not None and replay is not None:
            self.replay_endpoint = _last_endpoint(self._replay, replay)
        self.published = 0
        """Batches sent."""
        self.withheld = 0
        """Events of named tenants not published (see the module docstring)."""
        self.lost = 0
        """Events the source dropped before they could be published (:meth:`skip`)."""
        self._public_tag = None if tenant_events else tenant_tag(None)
        self._seq = 0
        self._kept: collections.deque[tuple[int, bytes]] = collections.deque()
        self._kept_bytes = 0
        self._replay_batches = replay_batches
        self._replay_bytes = replay_bytes
        self._subscriptions: dict[bytes, int] = {}
        self._subscribed = anyio.Event()
        self._closed = False
        log.info("kv_events_bound", endpoint=self.endpoint, replay=self.replay_endpoint)

    def _bind(
        self, sock: zmq.asyncio.Socket, url: str, curve_secret_key: bytes | None, field: str
    ) -> None:
        if curve_secret_key is not None:
            sock.curve_secretkey = curve_secret_key
            sock.curve_server = True
        try:
            sock.bind(url)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ConfigError(field, f"cannot bind {url}: {exc}") from None

    @property
    def subscribers(self) -> int:
        """Live subscriptions that receive this publisher's topic."""
        return sum(n for prefix, n in self._subscriptions.items() if self.topic.startswith(prefix))

    def info(self) -> dict[str, Any]:
        """The publisher's state, for stats replies."""
        return {
            "endpoint": self.endpoint,
            "replay": self.replay_endpoint,
            "topic": self.topic.decode(errors="replace"),
            "published": self.published,
            "withheld": self.withheld,
            "lost": self.lost,
            "next_seq": self._seq,
            "kept_for_replay": len(self._kept),
            "subscribers": self.subscribers,
        }

    async def wait_subscribed(self) -> None:
        """Return once a subscriber of this topic is connected (needs :meth:`run` or
        :meth:`watch_subscriptions` running)."""
        while not self.subscribers:
            if self._subscribed.is_set():
                self._subscribed = anyio.Event()
            await self._subscribed.wait()

    async def run(self, source: EventSource) -> None:
        """Publish ``source``'s events as they are recorded, and serve replays, until
        cancelled.

        Raises:
            EngineClosedError: from ``source`` when the engine closes under it.
        """
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(self.watch_subscriptions, name="kv-events-subscriptions")
            await self.publish_from(source)

    async def publish_from(self, source: EventSource) -> None:
        """As :meth:`run`, without watching subscriptions (the caller runs
        :meth:`watch_subscriptions` for the socket's whole life).

        Events the source dropped unread (its buffer was full) leave a gap: the sequence
        number skips one, so a subscriber sees that it missed something, and
        :attr:`lost` counts them.
        """
        seen = source.events_dropped
        while True:
            await source.wait_events()
            dropped = source.events_dropped
            if dropped > seen:
                self.skip(dropped - seen)
                seen = dropped
            await self.publish(
                source.take_events(), block_size=source.block_size, chunk_size=source.chunk_size
            )

    def skip(self, lost: int) -> None:
        """Leave a gap in the sequence numbers for ``lost`` events that will never be
        published (no replay can fill it)."""
        self._seq += 1
        self.lost += lost
        log.warning("kv_events_lost", events=lost, seq=self._seq - 1)

    async def publish(
        self, events: Sequence[KVEvent], *, block_size: int, chunk_size: int
    ) -> int | None:
        """Send ``events`` (chunks of ``chunk_size`` tokens) now as one batch of blocks of
        ``block_size``; returns its sequence number, or None when nothing was left to send.

        A subscriber whose queue is full misses it (the socket drops, it never waits); it
        stays available for replay.
        """
        public = self._public_tag
        wire: list[WireEvent] = []
        for event in events:
            if public is not None and not _of_tag(event, public):
                self.withheld += 1
                continue
            block = wire_events(event, block_size=block_size, chunk_size=chunk_size)
            if block is not None:
                wire.append(block)
        if not wire:
            return None
        payload = encode_batch(wire, time.time())
        seq = self._seq
        self._seq += 1
        self._keep(seq, payload)
        try:
            await self._socket.send_multipart(
                [self.topic, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK
            )
        except zmq.ZMQError as exc:
            if not self._socket.closed:
                log.warning("kv_event_send_failed", error=str(exc))
            return seq
        self.published += 1
        return seq

    def _keep(self, seq: int, payload: bytes) -> None:
        """Keep a batch for replay, dropping the oldest past either bound."""
        kept = self._kept
        kept.append((seq, payload))
        self._kept_bytes += len(payload)
        while kept and (len(kept) > self._replay_batches or self._kept_bytes > self._replay_bytes):
            self._kept_bytes -= len(kept.popleft()[1])

    async def watch_subscriptions(self) -> None:
        """Read the XPUB socket's subscription messages and keep the count, and serve
        replay requests, until cancelled or the sockets close."""
        async with anyio.create_task_group() as task_group:
            if self._replay is not None:
                task_group.start_soon(self._serve_replays, name="kv-events-replay")
            await self._watch()
            task_group.cancel_scope.cancel()

    async def _watch(self) -> None:
        while True:
            try:
                frame = await self._socket.recv()
            except zmq.ZMQError:
                if self._socket.closed:
                    return
                continue
            if not frame or frame[0] not in (_SUBSCRIBE, _UNSUBSCRIBE):
                continue
            prefix = bytes(frame[1:])
            count = self._subscriptions.get(prefix, 0)
            if frame[0] == _SUBSCRIBE:
                self._subscriptions[prefix] = count + 1
                log.info("kv_event_subscriber_joined", subscribers=self.subscribers)
            elif count > 1:
                self._subscriptions[prefix] = count - 1
            else:
                self._subscriptions.pop(prefix, None)
            if self.subscribers:
                self._subscribed.set()

    async def _serve_replays(self) -> None:
        """Answer each replay request: the batches kept from its start on, then the end."""
        sock = self._replay
        assert sock is not None
        while True:
            try:
                request = await sock.recv_multipart()
            except zmq.ZMQError:
                if sock.closed:
                    return
                continue
            if len(request) != 3 or request[1] or len(request[2]) != 8:
                log.warning("kv_event_replay_malformed", frames=len(request))
                continue
            client, start = request[0], int.from_bytes(request[2], "big")
            try:
                for seq, payload in list(self._kept):
                    if seq >= start:
                        await sock.send_multipart(
                            [client, b"", self.topic, seq.to_bytes(8, "big"), payload]
                        )
                await sock.send_multipart([client, b"", b"", END_OF_REPLAY, b""])
            except zmq.ZMQError as exc:
                if sock.closed:
                    return
                log.warning("kv_event_replay_failed", error=str(exc))

    def close(self) -> None:
        """Close the sockets (and the ipc socket files); idempotent."""
        if self._closed:
            return
        self._closed = True
        self._close_sockets()
        for endpoint in (self.endpoint, self.replay_endpoint):
            if endpoint is not None and endpoint.startswith("ipc://"):
                with contextlib.suppress(OSError):
                    os.unlink(endpoint.removeprefix("ipc://"))

    def _close_sockets(self) -> None:
        self._socket.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        if self._own_context:
            self._context.term()

    def __enter__(self) -> EventPublisher:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _last_endpoint(sock: zmq.asyncio.Socket, url: str) -> str:
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    return endpoint.decode() if isinstance(endpoint, bytes) and endpoint else url


def _of_tag(event: KVEvent, tag: bytes) -> bool:
    """Whether every chunk of ``event`` belongs to the tenant with ``tag``."""
    return all(digest[:TAG_BYTES] == tag for digest in event.block_hashes)


_PUBLIC_TAG: Final = tenant_tag(None)


def is_public(event: KVEvent) -> bool:
    """Whether every chunk of ``event`` is the unnamed tenant's (true of a clear): what a
    publisher sends unless asked to send named tenants' events too."""
    return _of_tag(event, _PUBLIC_TAG)
