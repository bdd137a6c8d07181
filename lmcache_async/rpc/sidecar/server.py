"""The sidecar server object: its sessions, the table routing each message type to a
handler, and the socket loop that reads requests and sends replies.

Requests are read in the event loop's reader callback (:class:`LoopSocket`, and the
same-host stream's :class:`~lmcache_async.rpc.stream.StreamRouter` beside it). One whose
route can answer without waiting (a PING, a HEARTBEAT, a LOOKUP by digests the CPU tier
answers) is answered right there; every other runs in a task of its own, at most
``max_concurrency`` at once. A bad message or a failing request gets an ERROR reply and the
server runs on.

Every message is checked against its sender (:mod:`~lmcache_async.rpc.sidecar.access`):
an admin's route refuses a client certificate (``FORBIDDEN``), a session serves only the
key that opened it, and a CURVE peer the ZAP handler refused never gets here.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket as socketlib
import time
from collections.abc import Sequence
from multiprocessing import shared_memory
from typing import Any, Final

import anyio
import zmq
import zmq.asyncio

from lmcache_async.engine import CacheEngine
from lmcache_async.errors import (
    EngineClosedError,
    InvalidInputError,
    PermissionDeniedError,
    ProtocolError,
)
from lmcache_async.logging import get_logger
from lmcache_async.rpc.events import EventPublisher
from lmcache_async.rpc.metrics import EngineCollector, LatencyTracker, MetricsServer
from lmcache_async.rpc.protocol import (
    ErrorCode,
    FrameLike,
    MessageType,
    decode,
    encode,
    error_reply,
    request_id_of,
    to_wire,
)
from lmcache_async.rpc.sidecar.access import LOCAL_ADMIN, Gatekeeper, Peer, Role, peer_of
from lmcache_async.rpc.sidecar.admin import AdminHandlers
from lmcache_async.rpc.sidecar.admission import Admission
from lmcache_async.rpc.sidecar.hello import SessionHandlers
from lmcache_async.rpc.sidecar.host import EngineHost
from lmcache_async.rpc.sidecar.lookups import LookupHandlers
from lmcache_async.rpc.sidecar.moves import MoveHandler
from lmcache_async.rpc.sidecar.pushes import PushHandler
from lmcache_async.rpc.sidecar.routes import TIMED_OPERATIONS, Busy, Route
from lmcache_async.rpc.sidecar.sessions import AFTER_COMMITS, InFlight, Session, Sessions
from lmcache_async.rpc.sidecar.settings import SidecarSettings
from lmcache_async.rpc.sidecar.transfers import TransferHandlers
from lmcache_async.rpc.stream import Outlets, StreamRouter
from lmcache_async.rpc.transport import LoopSocket
from lmcache_async.stats import EngineStats

__all__ = ["SidecarServer"]

log = get_logger(__name__)

_CAUSES_LOGGED: Final = 64
"""Distinct causes of failed replies logged with their traceback; later ones are counted."""


class SidecarServer:
    """The sessions, routes and socket loop of one sidecar;
    :func:`~lmcache_async.rpc.sidecar.serve` runs it.

    Message types map to handlers in one table (:meth:`_route_table`), each saying whether
    it needs a session and an open engine, so new operations are one method and one entry.
    """

    def __init__(
        self,
        settings: SidecarSettings,
        socket: zmq.asyncio.Socket,
        segment: shared_memory.SharedMemory,
    ) -> None:
        self.settings = settings
        self._socket = socket
        self._segment = segment
        self.instance = secrets.token_hex(8)
        self._started = time.monotonic()
        self.stopping = anyio.Event()
        self.host = EngineHost(settings, segment.buf)
        self.sessions = Sessions(
            self.host,
            timeout=settings.session_timeout,
            heartbeat_interval=settings.heartbeat_interval,
        )
        self._by_identity = self.sessions.by_identity  # read for every message
        self.admission = Admission(
            total=settings.max_concurrency, per_peer=settings.max_peer_requests
        )
        self.failed_replies = 0
        self._causes_logged: set[str] = set()
        self._io: Outlets | None = None
        self.stream_listener: socketlib.socket | None = None
        """The same-host stream socket (:mod:`~lmcache_async.rpc.stream`), served beside
        the ZeroMQ one when set."""
        self._inflight = 0
        self._idle = anyio.Event()
        self._idle.set()
        self._routes: dict[MessageType, Route] = self._route_table()
        # The routes that may answer in the reader callback, by their raw type frame.
        self._now_routes = {
            bytes((int(kind),)): route for kind, route in self._routes.items() if route.now
        }
        self.latency = LatencyTracker(tuple(TIMED_OPERATIONS.values()))
        self.publisher: EventPublisher | None = None
        self.metrics: MetricsServer | None = None
        self.gatekeeper: Gatekeeper | None = None
        self._curve = settings.curve_secret_key is not None

    def _route_table(self) -> dict[MessageType, Route]:
        hello = SessionHandlers(
            self.settings,
            self.host,
            self.sessions,
            instance=self.instance,
            segment_name=self._segment.name,
            segment_bytes=self._segment.size,
        )
        lookups = LookupHandlers(self.host, self.sessions)
        data = TransferHandlers(self.host, self.sessions)
        admin = AdminHandlers(self.host, status=self._status, stopping=self.stopping)
        moves = MoveHandler(self.settings, self.host)
        pushes = PushHandler(self.host)
        return {
            MessageType.HELLO: Route(hello.on_hello, needs_session=False, needs_engine=False),
            MessageType.HEARTBEAT: Route(hello.on_heartbeat, True, False, hello.heartbeat_now),
            MessageType.PING: Route(hello.on_ping, False, False, hello.ping_now),
            MessageType.LOOKUP: Route(lookups.on_lookup, True, True, lookups.now),
            MessageType.PREFETCH: Route(lookups.on_prefetch, True, True),
            MessageType.UNPIN: Route(lookups.on_unpin, True, True, lookups.unpin_now),
            MessageType.STORE: Route(data.on_store, True, True),
            MessageType.COMMIT: Route(data.on_commit, True, True),
            MessageType.RETRIEVE: Route(data.on_retrieve, True, True),
            MessageType.RELEASE: Route(data.on_release, True, True),
            MessageType.CLEAR: Route(admin.on_clear, False, True, admin=True),
            MessageType.ERASE: Route(admin.on_erase, False, True, admin=True),
            MessageType.FREEZE: Route(admin.on_freeze, False, True, admin=True),
            MessageType.HOT_CACHE: Route(admin.on_hot_cache, False, True, admin=True),
            MessageType.STATS: Route(
                admin.on_stats, False, False, for_clients=admin.on_client_stats
            ),
            MessageType.HEALTH: Route(admin.on_health, False, False),
            MessageType.SHUTDOWN: Route(admin.on_shutdown, False, False, admin=True),
            MessageType.PUSH: Route(pushes.on_push, True, True),
            MessageType.MOVE: Route(moves.on_move, False, True, admin=True),
        }

    @property
    def endpoint(self) -> str:
        return self.settings.listen

    @property
    def segment_name(self) -> str:
        return self._segment.name

    @property
    def engine(self) -> CacheEngine | None:
        """The engine, once a namespace is fixed (None before)."""
        return self.host.engine

    def info(self) -> dict[str, Any]:
        """The server's own state, for STATS replies."""
        namespace = self.host.namespace
        return {
            "instance": self.instance,
            "endpoint": self.endpoint,
            "pid": os.getpid(),
            "shm": self._segment.name,
            "shm_bytes": self._segment.size,
            "sessions": len(self.sessions),
            "transactions": self.sessions.transactions(),
            "session_lookup_ids": self.sessions.lookup_ids(),
            "namespace": None if namespace is None else namespace.to_wire(),
            "curve": self._curve,
            "peers_refused": 0 if self.gatekeeper is None else self.gatekeeper.refused,
            "busy_replies": self.admission.refused,
            "requests_in_flight": self.admission.in_flight,
            "failed_replies": self.failed_replies,
        }

    def _status(self) -> dict[str, Any]:
        """The server's part of a STATS reply (the engine's stats go first)."""
        return {
            "server": self.info(),
            "uptime_s": time.monotonic() - self._started,
            "latency": to_wire(self.latency.summaries()),
            "events": None if self.publisher is None else self.publisher.info(),
            "metrics": None if self.metrics is None else self.metrics.url,
        }

    def collector(self) -> EngineCollector:
        """A Prometheus collector of the engine's stats, request latencies and sessions."""

        def stats() -> EngineStats | None:
            engine = self.host.engine
            return None if engine is None else engine.stats()

        def extra() -> dict[str, float]:
            gauges = {
                "sidecar_sessions": float(len(self.sessions)),
                "sidecar_transactions": float(self.sessions.transactions()),
            }
            if self.gatekeeper is not None:
                gauges["sidecar_peers_refused"] = float(self.gatekeeper.refused)
            gauges["sidecar_busy_replies"] = float(self.admission.refused)
            gauges["sidecar_failed_replies"] = float(self.failed_replies)
            if self.publisher is not None:
                gauges["kv_event_subscribers"] = float(self.publisher.subscribers)
                gauges["kv_events_published"] = float(self.publisher.published)
            return gauges

        return EngineCollector(stats, latency=self.latency, extra=extra)

    async def host_engine(self) -> None:
        """Host the engine (:meth:`EngineHost.run`) until it is closed, publishing its KV
        events; the sessions end just before it closes."""
        await self.host.run(
            publisher=self.publisher, before_close=lambda: self.sessions.end_all("shutdown")
        )

    # -- the socket ---------------------------------------------------------------------

    async def receive(self) -> None:
        """Read requests and serve each in a task of its own, until cancelled; then the
        requests still running are cancelled and waited for.

        Requests are read in the event loop's reader callback (:class:`LoopSocket`) and run
        as plain asyncio tasks rather than in an anyio task group: on a small machine
        ``start_soon`` costs about 50 us a task against 9 us for ``create_task``, a large
        share of a lookup's round trip. The socket is always read: a data request that
        finds no slot (:class:`~.admission.Admission`) is answered ``busy`` at once, and
        the control requests take none.
        """
        loop = asyncio.get_running_loop()
        tasks: set[asyncio.Task[None]] = set()
        sessions = self._by_identity
        curve = self._curve
        admission = self.admission

        def on_message(frames: list[Any]) -> None:
            peer = peer_of(frames[-1]) if curve else LOCAL_ADMIN
            if peer is None:  # a CURVE socket delivers only what ZAP admitted
                log.warning("sidecar_message_without_peer")
                return
            identity = _frame_bytes(frames[0])
            session = sessions.get(identity)
            if session is not None and session.owner != peer.key:
                session = None  # another key's session: not this peer's to use
            if session is not None:
                session.last_seen = time.monotonic()
            if self._answered_now(session, frames):
                return
            kind = _kind_of(frames)
            who = peer.key.encode() if peer.key else identity
            if not admission.admit(who, kind):
                self._refuse_busy(io, frames)
                return
            self._inflight += 1
            self._idle = anyio.Event() if self._idle.is_set() else self._idle
            task = loop.create_task(self._handle(identity, frames, peer, who, kind))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            in_flight = None if session is None else _in_flight(session, kind)
            if in_flight is not None:  # counted before any later message is read
                in_flight.read()
                task.add_done_callback(in_flight.served)

        listener = self.stream_listener
        stream = None
        if listener is not None:
            max_frame = self.settings.limits.max_frame_bytes
            stream = StreamRouter(listener, on_message, max_frame_bytes=max_frame)
        io = Outlets(LoopSocket(self._socket, on_message), stream)
        self._io = io
        try:
            await anyio.sleep_forever()
        finally:
            io.detach()
            for task in tasks:
                task.cancel()
            if tasks:
                with anyio.CancelScope(shield=True):
                    await asyncio.wait(tasks)
            self._io = None

    def _refuse_busy(self, io: Outlets, frames: Sequence[FrameLike]) -> None:
        """Answer a request that found no slot: ``busy``, at once."""
        limits = self.settings.limits
        request_id = request_id_of(frames[1:], max_header_bytes=limits.max_header_bytes)
        reply = error_reply(
            request_id, ErrorCode.BUSY, "too many requests in flight: retry after some finish"
        )
        _send_reply(io, frames[0], reply)

    def _answered_now(self, session: Session | None, frames: Sequence[FrameLike]) -> bool:
        """Answer a request right in the socket's reader callback when its route can do so
        without waiting (a PING, a HEARTBEAT, a LOOKUP by chunk digests that the CPU tier
        answers alone): no task, no extra loop iteration. False when it must go the task's
        way (anything else, any doubt: that path also words every error reply)."""
        io = self._io
        if io is None or len(frames) < 3:
            return False
        route = self._now_routes.get(_frame_bytes(frames[1]))
        if (
            route is None
            or route.now is None
            or (route.needs_session and session is None)
            or (route.needs_engine and self.host.engine is None)
        ):
            return False
        started = time.perf_counter()
        limits = self.settings.limits
        try:
            message = decode(
                frames[1:],
                max_header_bytes=limits.max_header_bytes,
                max_payload_bytes=limits.max_payload_bytes,
            )
            header = route.now(session, message)
        except (ProtocolError, InvalidInputError, EngineClosedError, Busy):
            return False
        except Exception:  # a reader callback must not raise: the task's way reports it
            log.exception("sidecar_quick_answer_failed")
            return False
        if header is None:
            return False
        reply = encode(message.type, header, (), request_id=message.request_id)
        elapsed = time.perf_counter() - started
        _send_reply(io, frames[0], reply)
        operation = TIMED_OPERATIONS.get(message.type)
        if operation is not None:  # recorded once the reply is on its way
            self.latency.record(operation, elapsed)
        return True

    async def wait_idle(self) -> None:
        """Wait until no request is being served."""
        while self._inflight:
            await self._idle.wait()

    async def _handle(
        self, identity: bytes, frames: Sequence[FrameLike], peer: Peer, who: bytes, kind: int
    ) -> None:
        try:
            try:
                reply = await self._answer(identity, frames[1:], peer)
            except Exception as exc:  # a reply for every request, even one that failed here
                reply = self._failure_reply(frames[1:], "sidecar_handler_failed", exc)
            io = self._io
            if reply is None or io is None:
                return
            _send_reply(io, frames[0], reply)
        finally:
            self.admission.done(who, kind)
            self._inflight -= 1
            if not self._inflight:
                self._idle.set()

    def _failure_reply(
        self, body: Sequence[FrameLike], event: str, exc: BaseException
    ) -> list[bytes | memoryview]:
        """The ``internal`` ERROR reply to a request whose reply could not be had; the
        cause is logged once (with its traceback) and every occurrence counted."""
        self.failed_replies += 1
        cause = f"{event}:{type(exc).__name__}"
        if cause not in self._causes_logged and len(self._causes_logged) < _CAUSES_LOGGED:
            self._causes_logged.add(cause)
            log.error(event, error=f"{type(exc).__name__}: {exc}", exc_info=exc)
        limits = self.settings.limits
        request_id = request_id_of(body, max_header_bytes=limits.max_header_bytes)
        return error_reply(request_id, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")

    async def _answer(
        self, identity: bytes, body: Sequence[FrameLike], peer: Peer = LOCAL_ADMIN
    ) -> list[bytes | memoryview] | None:
        """The reply to one request from ``peer``: its handler's, or an ERROR reply saying
        why not (None for a request that gets no reply)."""
        limits = self.settings.limits
        try:
            message = decode(
                body,
                max_header_bytes=limits.max_header_bytes,
                max_payload_bytes=limits.max_payload_bytes,
            )
        except ProtocolError as exc:
            log.warning("sidecar_bad_message", reason=str(exc))
            request_id = request_id_of(body, max_header_bytes=limits.max_header_bytes)
            return error_reply(request_id, ErrorCode.PROTOCOL, str(exc))
        request_id = message.request_id
        route = self._routes.get(message.type)
        if route is None:
            return error_reply(
                request_id,
                ErrorCode.UNSUPPORTED,
                f"the sidecar does not serve {message.type.name} requests",
            )
        handler = route.handler
        if peer.role is not Role.ADMIN:
            if route.admin:
                log.info("sidecar_request_forbidden", type=message.type.name, key=peer.key)
                return error_reply(
                    request_id,
                    ErrorCode.FORBIDDEN,
                    f"{message.type.name} needs an admin certificate (--curve-admins)",
                )
            handler = route.for_clients or handler
        session = self._by_identity.get(identity)
        if session is not None and session.owner != peer.key:
            if message.type is MessageType.HELLO:
                return error_reply(
                    request_id, ErrorCode.PROTOCOL, "this identity belongs to another peer"
                )
            session = None
        if session is not None:
            session.last_seen = time.monotonic()
        if message.type is MessageType.HELLO:
            session = session or Session(identity, "", time.monotonic(), owner=peer.key)
        elif route.needs_session and session is None:
            return error_reply(
                request_id, ErrorCode.NO_SESSION, "no session: say HELLO (again) first"
            )
        if route.needs_engine and self.host.engine is None:
            return error_reply(
                request_id, ErrorCode.ENGINE_CLOSED, "no engine yet: no client has said HELLO"
            )
        if session is not None and session.commits.count and message.type in AFTER_COMMITS:
            await session.commits.settled(self.settings.config.store_timeout)
        operation = TIMED_OPERATIONS.get(message.type)
        started = time.perf_counter()
        try:
            result = await handler(session, message)
        except PermissionDeniedError as exc:
            return error_reply(request_id, ErrorCode.FORBIDDEN, str(exc))
        except Busy as exc:
            return error_reply(request_id, ErrorCode.BUSY, str(exc))
        except ProtocolError as exc:
            log.warning("sidecar_bad_request", type=message.type.name, reason=str(exc))
            return error_reply(request_id, ErrorCode.PROTOCOL, str(exc))
        except InvalidInputError as exc:
            return error_reply(request_id, ErrorCode.INVALID_INPUT, str(exc))
        except EngineClosedError as exc:
            return error_reply(request_id, ErrorCode.ENGINE_CLOSED, str(exc))
        except Exception as exc:
            log.exception("sidecar_request_failed", type=message.type.name)
            return error_reply(request_id, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")
        finally:
            if operation is not None:
                self.latency.record(operation, time.perf_counter() - started)
        if result is None:
            return None
        header, payloads = result
        try:
            return encode(message.type, header, payloads, request_id=request_id)
        except (TypeError, ValueError, OverflowError, ProtocolError) as exc:
            return self._failure_reply(body, "sidecar_reply_unencodable", exc)


def _in_flight(session: Session, kind: int) -> InFlight | None:
    """What counts a session's ``kind`` requests served in a task, which its later
    requests may wait for (COMMITs, LOOKUPs); None for other kinds."""
    if kind == MessageType.COMMIT:
        return session.commits
    if kind == MessageType.LOOKUP:
        return session.lookups
    return None


def _kind_of(frames: Sequence[FrameLike]) -> int:
    """The message type byte of a raw request (-1 when it has none: the handler's
    decoding refuses it)."""
    if len(frames) < 2:
        return -1
    kind = _frame_bytes(frames[1])
    return kind[0] if len(kind) == 1 else -1


def _send_reply(io: Outlets, identity: FrameLike, reply: Sequence[FrameLike]) -> None:
    """Queue a reply to the client ``identity`` names (logged, not raised, when it fails)."""
    try:
        if not io.send_nowait([identity, *reply], copy=False):
            log.warning("sidecar_reply_dropped", reason="the client's queue is full")
    except zmq.ZMQError as exc:
        if not io.closed:
            log.warning("sidecar_reply_failed", error=str(exc))


def _frame_bytes(frame: FrameLike) -> bytes:
    if isinstance(frame, zmq.Frame):
        return frame.bytes
    return bytes(frame)
