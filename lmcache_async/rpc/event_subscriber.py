"""The receiving side of KV events (:mod:`lmcache_async.rpc.events`): a subscriber that
reads vLLM-format batches in order, asks the publisher's replay socket for what it missed,
and ``lmcache-async events``, which prints them.

A subscriber with a replay address starts by asking for every batch the publisher still
holds (so one that connected before the publisher bound misses nothing kept), and asks
again whenever the sequence numbers jump; each batch is handed on once, in order.
"""

from __future__ import annotations

import collections
import contextlib
import json
import signal
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Final

import anyio
import zmq
import zmq.asyncio

from lmcache_async.errors import InvalidInputError, ProtocolError
from lmcache_async.keys.tokens import is_strict_int
from lmcache_async.logging import get_logger
from lmcache_async.rpc.events import DEFAULT_EVENT_TOPIC, END_OF_REPLAY
from lmcache_async.rpc.kv_wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    WireEvent,
    decode_batch,
)

if TYPE_CHECKING:
    from lmcache_async.rpc.curve import CurveClientKeys

__all__ = [
    "DEFAULT_MAX_EVENT_BYTES",
    "EventSubscriber",
    "ReceivedBatch",
    "format_batch",
    "tail_events",
]

log = get_logger(__name__)

DEFAULT_MAX_EVENT_BYTES: Final = 64 << 20
"""Largest batch message a subscriber accepts (ZeroMQ drops a peer sending more)."""
REPLAY_TIMEOUT: Final = 5.0
"""How long a replay may take before the subscriber goes on without it."""


@dataclass(frozen=True, slots=True)
class ReceivedBatch:
    """A batch as a subscriber got it: its sequence number, time and events."""

    seq: int
    ts: float
    events: tuple[WireEvent, ...]


def _parse(frames: list[bytes], topic: bytes) -> ReceivedBatch:
    """One ``[topic, seq, payload]`` message.

    Raises:
        ProtocolError: not three frames, another topic, a bad sequence number or payload.
    """
    if len(frames) != 3:
        raise ProtocolError(f"a batch message has 3 frames, got {len(frames)}")
    if topic and not bytes(frames[0]).startswith(topic):
        raise ProtocolError(f"batch topic {bytes(frames[0])[:40]!r} is not {topic!r}")
    if len(frames[1]) != 8:
        raise ProtocolError("a batch's sequence number is 8 bytes")
    ts, events = decode_batch(frames[2])
    return ReceivedBatch(int.from_bytes(frames[1], "big"), ts, tuple(events))


class EventSubscriber:
    """Receives a publisher's batches in order: ``async for batch in subscriber``.

    ``replay``: the publisher's replay address (``--events-replay``): batches missed before
    the first one received, or between two, are asked for there. Malformed messages are
    logged and skipped (:attr:`skipped`); :attr:`missed` counts batches lost for good. Use as
    a context manager or call :meth:`close`.

    Raises (constructor):
        InvalidInputError: a URL is not a string.
    """

    def __init__(
        self,
        url: str,
        *,
        topic: bytes = DEFAULT_EVENT_TOPIC,
        replay: str | None = None,
        max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
        context: zmq.asyncio.Context | None = None,
        keys: CurveClientKeys | None = None,
    ) -> None:
        for name, value in (("url", url), ("replay", replay)):
            if value is not None and (not isinstance(value, str) or "://" not in value):
                raise InvalidInputError(f"{name}: expected an ipc:// or tcp:// URL, got {value!r}")
        self.url = url
        self.topic = topic
        self._keys = keys
        self._own_context = context is None
        self._context = zmq.asyncio.Context() if context is None else context
        self._sockets: list[zmq.asyncio.Socket] = []
        self._socket = self._open(zmq.SUB, url, max_event_bytes)
        self._socket.setsockopt(zmq.SUBSCRIBE, topic)
        self._replay = None if replay is None else self._open(zmq.DEALER, replay, max_event_bytes)
        self.missed = 0
        self.skipped = 0
        self._next_seq: int | None = 0 if replay is not None else None
        self._ready: collections.deque[ReceivedBatch] = collections.deque()

    def _open(self, kind: int, url: str, max_bytes: int) -> zmq.asyncio.Socket:
        sock = self._context.socket(kind)
        self._sockets.append(sock)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
        if self._keys is not None:
            self._keys.apply(sock)
        try:
            sock.connect(url)
        except zmq.ZMQError as exc:
            self.close()
            raise InvalidInputError(f"cannot connect to {url}: {exc}") from None
        return sock

    async def receive(self) -> ReceivedBatch:
        """The next batch in order (bound the wait with a cancel scope). A publisher that
        restarted numbers from 0 again; that is not counted as missed."""
        while not self._ready:
            frames = await self._socket.recv_multipart()
            try:
                batch = _parse(frames, self.topic)
            except ProtocolError as exc:
                self.skipped += 1
                log.warning("kv_event_malformed", reason=str(exc))
                continue
            expected = self._next_seq
            if expected is not None and batch.seq < expected and batch.seq != 0:
                continue  # already had it from a replay
            if expected is not None and batch.seq > expected:
                await self._fill(expected, batch.seq)
            self._ready.append(batch)
            self._next_seq = batch.seq + 1
        return self._ready.popleft()

    async def _fill(self, start: int, end: int) -> None:
        """Ask the replay socket for batches ``start..end-1``; what it cannot give is
        counted as missed."""
        got: list[ReceivedBatch] = []
        if self._replay is not None:
            with anyio.move_on_after(REPLAY_TIMEOUT):
                await self._replay.send_multipart([b"", start.to_bytes(8, "big")])
                while True:
                    frames = await self._replay.recv_multipart()
                    if len(frames) == 4 and frames[2] == END_OF_REPLAY:
                        break
                    try:
                        batch = _parse(frames[1:], self.topic)
                    except ProtocolError as exc:
                        log.warning("kv_event_replay_malformed", reason=str(exc))
                        continue
                    if start <= batch.seq < end:
                        got.append(batch)
        self.missed += (end - start) - len(got)
        self._ready.extend(sorted(got, key=lambda batch: batch.seq))

    async def __aiter__(self) -> AsyncIterator[ReceivedBatch]:
        while True:
            yield await self.receive()

    def close(self) -> None:
        """Close the sockets; idempotent."""
        for sock in self._sockets:
            if not sock.closed:
                sock.close(linger=0)
        if self._own_context and not self._context.closed:
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


def _event_fields(event: WireEvent) -> dict[str, object]:
    if isinstance(event, BlockStored):
        return {
            "type": "BlockStored",
            "medium": event.medium,
            "block_size": event.block_size,
            "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_block_hash,
            "token_ids": list(event.token_ids),
        }
    if isinstance(event, BlockRemoved):
        return {
            "type": "BlockRemoved",
            "medium": event.medium,
            "block_hashes": list(event.block_hashes),
        }
    assert isinstance(event, AllBlocksCleared)
    return {"type": "AllBlocksCleared"}


def format_batch(batch: ReceivedBatch, *, as_json: bool = False) -> list[str]:
    """Lines for ``lmcache-async events``, one per event: JSON or a short summary."""
    lines = []
    for event in batch.events:
        fields = _event_fields(event)
        if as_json:
            lines.append(
                json.dumps({"seq": batch.seq, "ts": batch.ts, **fields}, separators=(",", ":"))
            )
            continue
        hashes = fields.get("block_hashes") or []
        assert isinstance(hashes, list)
        span = f"{hashes[0]:016x}..{hashes[-1]:016x}" if hashes else "-"
        medium = fields.get("medium", "*")
        summary = f"{batch.seq:>6} {fields['type']:<16} {medium:<4} blocks={len(hashes)}"
        if isinstance(event, BlockStored):
            parent = event.parent_block_hash
            summary += (
                f" block_size={event.block_size} tokens={len(event.token_ids)}"
                f" parent={'-' if parent is None else f'{parent:016x}'}"
            )
        lines.append(f"{summary} hashes={span}")
    return lines


async def tail_events(
    url: str,
    on_batch: Callable[[ReceivedBatch], None],
    *,
    topic: bytes = DEFAULT_EVENT_TOPIC,
    replay: str | None = None,
    count: int | None = None,
    stop_on_signals: bool = True,
    keys: CurveClientKeys | None = None,
) -> int:
    """Hand each batch published at ``url`` to ``on_batch`` until ``count`` were received,
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
        subscriber = stack.enter_context(
            EventSubscriber(url, topic=topic, replay=replay, keys=keys)
        )
        async with anyio.create_task_group() as task_group:
            if signals is not None:
                task_group.start_soon(_cancel_on_signal, signals, task_group.cancel_scope)
            while count is None or received < count:
                on_batch(await subscriber.receive())
                received += 1
            task_group.cancel_scope.cancel()
    return received


async def _cancel_on_signal(signals: AsyncIterator[int], scope: anyio.CancelScope) -> None:
    async for signum in signals:
        log.debug("kv_events_tail_stopped", signal=signal.Signals(signum).name)
        scope.cancel()
        return
