"""KV events over ZeroMQ PUB/SUB: what a KV-aware router learns about a cache's contents.

An :class:`EventPublisher` binds an XPUB socket and publishes every event an engine records
(chunks stored into or removed from a tier) as a two-frame message::

    [topic (b"kv" by default), msgpack map]

The map holds ``kind`` (``"stored"`` / ``"removed"``), ``block_hashes`` (list of bytes, the
chunk key digests in prefix order), ``parent_block_hash`` (bytes or nil), ``token_ids``
(list of int, empty for ``removed``), ``block_size`` (tokens per chunk), ``medium`` (the tier:
``"cpu"``, ``"disk"``, ``"redis"``), ``ts`` (float, seconds since the epoch, when the engine
recorded it), ``seq`` (per-publisher sequence number, from 0: a gap means the subscriber
missed events) and ``v`` (:data:`EVENT_FORMAT_VERSION`). No pickle.

The publisher wakes when the engine records an event (no polling). A slow or stuck
subscriber never slows the engine: PUB sockets drop messages for a subscriber whose queue
(``SNDHWM``) is full, and the engine's own buffer is bounded too. :class:`EventSubscriber`
is the receiving side (``lmcache-async events``).

Events name chunks by their digests and carry the prompt's tokens, so they are as private
as the prompts. A publisher given the sidecar's CURVE secret key serves only subscribers
the sidecar's allow-list admits (the ZAP handler of the shared context decides), and by
default it withholds every event of a *named* tenant (chunks whose key tag is not the
unnamed tenant's): ``tenant_events=True`` publishes them too, and a subscriber then learns
those tenants' prompts and the digests that look them up (never their names).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, Protocol

import anyio
import anyio.lowlevel
import msgpack
import structlog
import zmq
import zmq.asyncio

from lmcache_async.errors import ConfigError, InvalidInputError, ProtocolError
from lmcache_async.events import EventKind, KVEvent
from lmcache_async.keys.tokens import is_strict_int
from lmcache_async.rpc.transport import check_listen_url
from lmcache_async.tenancy.tenants import TAG_BYTES, tenant_tag

if TYPE_CHECKING:  # a subscriber needs no engine
    from lmcache_async.engine import CacheEngine
    from lmcache_async.rpc.curve import CurveClientKeys

__all__ = [
    "DEFAULT_EVENT_SNDHWM",
    "DEFAULT_EVENT_TOPIC",
    "EVENT_FORMAT_VERSION",
    "EventPublisher",
    "EventSource",
    "EventSubscriber",
    "ReceivedEvent",
    "decode_event",
    "encode_event",
    "engine_event_source",
    "format_event",
    "tail_events",
]

log = structlog.get_logger(__name__)

EVENT_FORMAT_VERSION: Final = 1
"""Version of the event map (``"v"``); a subscriber skips events of another version."""
DEFAULT_EVENT_TOPIC: Final = b"kv"
"""The topic frame of every event message."""
DEFAULT_EVENT_SNDHWM: Final = 10_000
"""Messages queued per subscriber before the socket drops further ones for it."""
DEFAULT_MAX_EVENT_BYTES: Final = 64 << 20
"""Largest event message a subscriber accepts (ZeroMQ drops a peer sending more)."""

_YIELD_EVERY: Final = 256  # events sent between two checkpoints, so one batch cannot hog the loop
_SUBSCRIBE: Final = 1
_UNSUBSCRIBE: Final = 0
_KINDS: Final = {kind.value: kind for kind in EventKind}


class EventSource(Protocol):
    """Where a publisher reads events: a :class:`~lmcache_async.CacheEngine` (or anything
    with the same two methods, such as an adapter over an
    :class:`~lmcache_async.events.EventBuffer`)."""

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

    def take_events(self) -> list[KVEvent]:
        return self._engine.take_events()

    async def wait_events(self) -> None:
        await self._engine.wait_events()


def engine_event_source(engine: CacheEngine) -> EventSource:
    """The events ``engine`` records, as an :class:`EventSource` for a publisher."""
    return _EngineEvents(engine)


@dataclass(frozen=True, slots=True)
class ReceivedEvent:
    """An event as a subscriber got it: the publisher's sequence number and the event."""

    seq: int
    event: KVEvent


def encode_event(event: KVEvent, seq: int, *, topic: bytes = DEFAULT_EVENT_TOPIC) -> list[bytes]:
    """The frames of one event message: ``[topic, msgpack map]``.

    Raises:
        InvalidInputError: ``seq`` is not an int >= 0, or the event holds a value msgpack
            cannot pack.
    """
    if not is_strict_int(seq) or seq < 0:
        raise InvalidInputError(f"seq must be an int >= 0, got {seq!r}")
    fields = {
        "v": EVENT_FORMAT_VERSION,
        "seq": seq,
        "kind": event.kind.value,
        "block_hashes": list(event.block_hashes),
        "parent_block_hash": event.parent_block_hash,
        "token_ids": list(event.token_ids),
        "block_size": event.block_size,
        "medium": event.medium,
        "ts": float(event.ts),
    }
    try:
        packed: bytes = msgpack.packb(fields, use_bin_type=True, datetime=False)
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidInputError(f"event cannot be encoded: {exc}") from None
    return [topic, packed]


def _refuse_ext(code: int, data: bytes) -> object:
    raise ProtocolError(f"event holds a msgpack extension type ({code})")


def _field(fields: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    value = fields.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ProtocolError(f"event field {name!r} is missing or malformed")
    return value


def _bytes_list(value: object, name: str) -> tuple[bytes, ...]:
    if not isinstance(value, list) or not all(isinstance(item, bytes) for item in value):
        raise ProtocolError(f"event field {name!r} must be a list of bytes")
    return tuple(value)


def decode_event(frames: Sequence[bytes], *, topic: bytes | None = None) -> ReceivedEvent:
    """Check and decode one event message made by :func:`encode_event`.

    ``topic`` (when given) must match the first frame.

    Raises:
        ProtocolError: not two frames, another topic, invalid msgpack, an extension type,
            another format version, or a missing or malformed field.
    """
    if len(frames) != 2:
        raise ProtocolError(f"an event message has 2 frames, got {len(frames)}")
    if topic is not None and bytes(frames[0]) != topic:
        raise ProtocolError(f"event topic {bytes(frames[0])[:40]!r} is not {topic!r}")
    try:
        fields = msgpack.unpackb(
            frames[1], raw=False, strict_map_key=True, ext_hook=_refuse_ext, timestamp=0
        )
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises many types (ExtraData, StackError, ...)
        raise ProtocolError(f"event is not valid msgpack: {type(exc).__name__}") from None
    if not isinstance(fields, dict):
        raise ProtocolError(f"an event must be a msgpack map, got {type(fields).__name__}")
    version = fields.get("v")
    if not is_strict_int(version) or version != EVENT_FORMAT_VERSION:
        raise ProtocolError(f"event format version {version!r:.40} is not supported")
    kind = _KINDS.get(fields.get("kind"))  # type: ignore[arg-type]
    if kind is None:
        raise ProtocolError(f"unknown event kind {fields.get('kind')!r:.40}")
    seq = _field(fields, "seq", int)
    block_size = _field(fields, "block_size", int)
    if seq < 0 or block_size < 1:
        raise ProtocolError("event fields 'seq' and 'block_size' are out of range")
    parent = fields.get("parent_block_hash")
    if parent is not None and not isinstance(parent, bytes):
        raise ProtocolError("event field 'parent_block_hash' must be bytes or nil")
    token_ids = fields.get("token_ids")
    if not isinstance(token_ids, list) or not all(is_strict_int(t) for t in token_ids):
        raise ProtocolError("event field 'token_ids' must be a list of ints")
    ts = _field(fields, "ts", (int, float))
    if not math.isfinite(ts):
        raise ProtocolError("event field 'ts' must be a finite number")
    event = KVEvent(
        kind=kind,
        block_hashes=_bytes_list(fields.get("block_hashes"), "block_hashes"),
        parent_block_hash=parent,
        token_ids=tuple(token_ids),
        block_size=block_size,
        medium=_field(fields, "medium", str),
        ts=float(ts),
    )
    return ReceivedEvent(seq, event)


def _check_bind_url(url: str, allow_remote: bool) -> str:
    """A publisher's bind address, checked as a sidecar's listen address is.

    Raises:
        ConfigError: ``field="events"`` naming what is wrong.
    """
    try:
        return check_listen_url(url, allow_remote=allow_remote)
    except ConfigError as exc:
        message = str(exc).removeprefix("listen: ")
        raise ConfigError("events", message) from None


class EventPublisher:
    """Publishes an :class:`EventSource`'s events on a bound XPUB socket.

    The socket binds at construction, so subscribers may connect before the engine exists;
    :meth:`run` then publishes one source's events until cancelled. An XPUB socket (a PUB
    that also reports subscriptions) lets :attr:`subscribers` and :meth:`wait_subscribed`
    say whether anyone listens. Use as a context manager or call :meth:`close`.

    Raises (constructor):
        ConfigError: ``field="events"``: the URL is not ``ipc://PATH`` or
            ``tcp://HOST:PORT``, binds beyond loopback without ``allow_remote``, or cannot
            be bound.
        InvalidInputError: ``topic`` is empty or ``sndhwm`` is not a positive int.
    """

    def __init__(
        self,
        url: str,
        *,
        topic: bytes = DEFAULT_EVENT_TOPIC,
        sndhwm: int = DEFAULT_EVENT_SNDHWM,
        allow_remote: bool = False,
        context: zmq.asyncio.Context | None = None,
        curve_secret_key: bytes | None = None,
        tenant_events: bool = False,
    ) -> None:
        if not isinstance(topic, bytes) or not topic:
            raise InvalidInputError("topic must be non-empty bytes")
        if not is_strict_int(sndhwm) or sndhwm < 1:
            raise InvalidInputError(f"sndhwm must be a positive int, got {sndhwm!r}")
        _check_bind_url(url, allow_remote)
        self.topic = topic
        self._own_context = context is None
        self._context = zmq.asyncio.Context() if context is None else context
        self._socket = self._context.socket(zmq.XPUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, sndhwm)
        self._socket.setsockopt(zmq.XPUB_VERBOSER, 1)  # every (un)subscription, to count them
        if curve_secret_key is not None:
            self._socket.curve_secretkey = curve_secret_key
            self._socket.curve_server = True
        try:
            self._socket.bind(url)
        except zmq.ZMQError as exc:
            self._close_socket()
            raise ConfigError("events", f"cannot bind {url}: {exc}") from None
        endpoint = self._socket.getsockopt(zmq.LAST_ENDPOINT)
        self.endpoint: str = endpoint.decode() if isinstance(endpoint, bytes) else url
        self._ipc_path = self.endpoint.removeprefix("ipc://") if url.startswith("ipc://") else None
        self.published = 0
        self.withheld = 0
        self._public_tag = None if tenant_events else tenant_tag(None)
        self._seq = 0
        self._subscriptions: dict[bytes, int] = {}
        self._subscribed = anyio.Event()
        self._closed = False
        log.info("kv_events_bound", endpoint=self.endpoint, topic=topic.decode(errors="replace"))

    @property
    def subscribers(self) -> int:
        """Live subscriptions that receive this publisher's topic."""
        return sum(n for prefix, n in self._subscriptions.items() if self.topic.startswith(prefix))

    def info(self) -> dict[str, Any]:
        """The publisher's state, for stats replies."""
        return {
            "endpoint": self.endpoint,
            "topic": self.topic.decode(errors="replace"),
            "published": self.published,
            "withheld": self.withheld,
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
        """Publish ``source``'s events as they are recorded, until cancelled.

        Raises:
            EngineClosedError: from ``source`` when the engine closes under it.
        """
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(self.watch_subscriptions, name="kv-events-subscriptions")
            await self.publish_from(source)

    async def publish_from(self, source: EventSource) -> None:
        """As :meth:`run`, without watching subscriptions (the caller runs
        :meth:`watch_subscriptions` for the socket's whole life)."""
        while True:
            await source.wait_events()
            await self.publish(source.take_events())

    async def publish(self, events: Sequence[KVEvent]) -> int:
        """Send ``events`` now; returns how many were handed to the socket.

        A subscriber whose queue is full misses them (the socket drops, it never waits).
        """
        sent = 0
        public = self._public_tag
        for event in events:
            if public is not None and not _of_tag(event, public):
                self.withheld += 1
                continue
            frames = encode_event(event, self._seq, topic=self.topic)
            self._seq += 1
            try:
                await self._socket.send_multipart(frames, flags=zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                if self._socket.closed:
                    break
                log.warning("kv_event_send_failed", error=str(exc))
                continue
            sent += 1
            if sent % _YIELD_EVERY == 0:
                await anyio.lowlevel.checkpoint()
        self.published += sent
        return sent

    async def watch_subscriptions(self) -> None:
        """Read the XPUB socket's subscription messages and keep the count, until
        cancelled or the socket closes."""
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

    def close(self) -> None:
        """Close the socket (and the ipc socket file); idempotent."""
        if self._closed:
            return
        self._closed = True
        self._close_socket()
        if self._ipc_path:
            with contextlib.suppress(OSError):
                os.unlink(self._ipc_path)

    def _close_socket(self) -> None:
        self._socket.close(linger=0)
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


def _of_tag(event: KVEvent, tag: bytes) -> bool:
    """Whether every chunk of ``event`` belongs to the tenant with ``tag``."""
    return all(digest[:TAG_BYTES] == tag for digest in event.block_hashes)


class EventSubscriber:
    """Receives a publisher's events: ``async for received in subscriber``.

    Malformed messages are logged and skipped; :attr:`missed` counts events lost between
    two received ones (gaps in the sequence numbers), :attr:`skipped` malformed ones. Use
    as a context manager or call :meth:`close`.

    Raises (constructor):
        InvalidInputError: ``url`` is not a string.
    """

    def __init__(
        self,
        url: str,
        *,
        topic: bytes = DEFAULT_EVENT_TOPIC,
        max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
        context: zmq.asyncio.Context | None = None,
        keys: CurveClientKeys | None = None,
    ) -> None:
        if not isinstance(url, str) or "://" not in url:
            raise InvalidInputError(f"expected an ipc:// or tcp:// URL, got {url!r}")
        self.url = url
        self.topic = topic
        self._own_context = context is None
        self._context = zmq.asyncio.Context() if context is None else context
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, max_event_bytes)
        self._socket.setsockopt(zmq.SUBSCRIBE, topic)
        if keys is not None:
            keys.apply(self._socket)
        try:
            self._socket.connect(url)
        except zmq.ZMQError as exc:
            self.close()
            raise InvalidInputError(f"cannot connect to {url}: {exc}") from None
        self.missed = 0
        self.skipped = 0
        self._next_seq: int | None = None

    async def receive(self) -> ReceivedEvent:
        """Wait for the next well-formed event (bound the wait with a cancel scope).

        A publisher that restarted numbers from 0 again; that is not counted as missed.
        """
        while True:
            frames = await self._socket.recv_multipart()
            try:
                received = decode_event(frames, topic=self.topic)
            except ProtocolError as exc:
                self.skipped += 1
                log.warning("kv_event_malformed", reason=str(exc))
                continue
            if self._next_seq is not None and received.seq > self._next_seq:
                self.missed += received.seq - self._next_seq
            self._next_seq = received.seq + 1
            return received

    async def __aiter__(self) -> AsyncIterator[ReceivedEvent]:
        while True:
            yield await self.receive()

    def close(self) -> None:
        """Close the socket; idempotent."""
        if not self._socket.closed:
            self._socket.close(linger=0)
            if self._own_context:
                self._context.term()

    def __enter__(self) -> EventSubscriber:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def format_event(received: ReceivedEvent, *, as_json: bool = False) -> str:
    """One line for ``lmcache-async events``: JSON (hashes as hex) or a short summary."""
    event = received.event
    parent = event.parent_block_hash
    if as_json:
        return json.dumps(
            {
                "seq": received.seq,
                "kind": event.kind.value,
                "block_hashes": [h.hex() for h in event.block_hashes],
                "parent_block_hash": None if parent is None else parent.hex(),
                "token_ids": list(event.token_ids),
                "block_size": event.block_size,
                "medium": event.medium,
                "ts": event.ts,
            },
            separators=(",", ":"),
        )
    hashes = event.block_hashes
    span = f"{hashes[0][:6].hex()}..{hashes[-1][:6].hex()}" if hashes else "-"
    return (
        f"{received.seq:>6} {event.kind.value:<7} {event.medium:<5} blocks={len(hashes)} "
        f"block_size={event.block_size} tokens={len(event.token_ids)} "
        f"parent={parent[:6].hex() if parent else '-'} hashes={span}"
    )


async def tail_events(
    url: str,
    on_event: Callable[[ReceivedEvent], None],
    *,
    topic: bytes = DEFAULT_EVENT_TOPIC,
    count: int | None = None,
    stop_on_signals: bool = True,
    keys: CurveClientKeys | None = None,
) -> int:
    """Hand each event published at ``url`` to ``on_event`` until ``count`` were received,
    SIGINT or SIGTERM (with ``stop_on_signals``), or cancellation; returns how many were.

    Raises:
        InvalidInputError: a bad URL or ``count`` below 1.
    """
    if count is not None and (not is_strict_int(count) or count < 1):
        raise InvalidInputError(f"count must be a positive int, got {count!r}")
    received = 0
    with contextlib.ExitStack() as stack:
        # Signals are caught before subscribing: once the publisher sees the subscription,
        # a SIGINT must stop the loop, not raise KeyboardInterrupt.
        signals = (
            stack.enter_context(anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM))
            if stop_on_signals
            else None
        )
        subscriber = stack.enter_context(EventSubscriber(url, topic=topic, keys=keys))
        async with anyio.create_task_group() as task_group:
            if signals is not None:
                task_group.start_soon(_cancel_on_signal, signals, task_group.cancel_scope)
            while count is None or received < count:
                on_event(await subscriber.receive())
                received += 1
            task_group.cancel_scope.cancel()
    return received


async def _cancel_on_signal(signals: AsyncIterator[int], scope: anyio.CancelScope) -> None:
    async for signum in signals:
        log.debug("kv_events_tail_stopped", signal=signal.Signals(signum).name)
        scope.cancel()
        return
