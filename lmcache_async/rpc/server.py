"""The sidecar cache server: a :class:`CacheEngine`'s storage tiers in a process of their own.

``lmcache-async serve`` runs :func:`serve`. Serving-engine workers connect with
:class:`~lmcache_async.rpc.client.RemoteCacheEngine` over a ROUTER socket (``ipc://`` by
default, ``tcp://`` on loopback unless remote binds are allowed, optionally CURVE-encrypted).

The server serves one namespace (model, revision, tenant, KV layout): the first client's
HELLO fixes it and opens the engine, unless :class:`SidecarSettings` names one; a client
asking for another is refused. The engine's host arena is a
:mod:`multiprocessing.shared_memory` segment, so a client on the same host copies KV bytes
straight into and out of the payloads the server allocates or holds:

- store: STORE (tokens or block hashes) → the server skips chunks it has, allocates the
  others and replies their offsets in a *transaction* → the client gathers its KV into
  them → COMMIT → the server puts them into its tiers and replies the tokens stored;
- retrieve: RETRIEVE → the server looks up and fetches the chunks (from disk or Redis too)
  and holds them in a transaction → the client scatters them into its KV memory →
  RELEASE (no reply) → the server lets them go.

A client on another host sends the payloads inline in the COMMIT and gets them inline in
the RETRIEVE reply.

Moves between instances (:meth:`CacheEngine.move <lmcache_async.CacheEngine.move>`):

- PUSH (tokens, then one inline payload per chunk with its xxh3-64 checksum) → the server
  copies each payload into its memory, checks the copy against the checksum, caches the
  leading run that passes (refusing a corrupt or mis-sized chunk and the rest), flushes
  queued tier writes and replies the tokens it took;
- MOVE (tokens, ``old_position``, ``new_position``, ``copy``) → the server's engine moves
  the prefix to the other sidecar (by PUSH) and replies the tokens moved.

Each client has a session, kept alive by its requests and heartbeats; a session silent for
``client_timeout`` seconds is dropped with its transactions and its lookup pins (lookup ids
are scoped per session). Every request runs in a task of its own; a bad message or a
failing request gets an ERROR reply and the server runs on. SIGTERM or SIGINT shut it down
in order: requests in flight finish (bounded), transactions end, queued tier writes are
flushed, the tiers close, the shared memory is unlinked and the ipc socket file removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import ipaddress
import itertools
import math
import os
import secrets
import signal
import socket as socketlib
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing import shared_memory
from typing import Any, Final, TypeAlias

import anyio
import anyio.to_thread
import numpy as np
import structlog
import zmq
import zmq.asyncio
from anyio.abc import TaskGroup

from lmcache_async.backends.record import payload_checksum
from lmcache_async.config import EngineConfig
from lmcache_async.engine import CacheEngine
from lmcache_async.errors import (
    AllocationTimeoutError,
    ConfigError,
    EngineClosedError,
    InvalidInputError,
    ProtocolError,
)
from lmcache_async.keys import DIGEST_SIZE, ChunkSpan
from lmcache_async.layouts import KVLayout
from lmcache_async.memory import MemoryObj
from lmcache_async.rpc.events import EventPublisher, engine_event_source
from lmcache_async.rpc.metrics import EngineCollector, LatencyTracker, MetricsServer, make_registry
from lmcache_async.rpc.protocol import (
    ErrorCode,
    FrameLike,
    Message,
    MessageLimits,
    MessageType,
    decode,
    encode,
    error_reply,
    hashes_from_wire,
    request_id_of,
    to_wire,
    tokens_from_payload,
)
from lmcache_async.rpc.transport import LoopSocket
from lmcache_async.stats import EngineStats
from lmcache_async.tokens import is_strict_int

__all__ = [
    "DEFAULT_HEARTBEAT_INTERVAL",
    "DEFAULT_SIDECAR_LIMITS",
    "SidecarNamespace",
    "SidecarServer",
    "SidecarSettings",
    "boot_id",
    "check_listen_url",
    "default_endpoint",
    "load_curve_secret_key",
    "serve",
]

log = structlog.get_logger(__name__)

DEFAULT_HEARTBEAT_INTERVAL: Final = 1.0
"""Seconds between a client's heartbeats (told to the client in the HELLO reply)."""
DEFAULT_CLIENT_TIMEOUT_BEATS: Final = 5
"""A session silent for this many heartbeat intervals is dropped (default timeout): a few
missed beats, so a client whose event loop stalls for a moment keeps its session."""
DEFAULT_SIDECAR_LIMITS: Final = MessageLimits(max_header_bytes=4 << 20, max_payload_bytes=1 << 30)
"""Sidecar messages: a 4 MiB header (block hashes, chunk lists), 1 GiB of inline payload."""
DEFAULT_MAX_CONCURRENCY: Final = 64
"""Requests served at once; further ones wait in the socket's queue."""
SHUTDOWN_GRACE_SECONDS: Final = 10.0
"""How long shutdown waits for requests in flight before cancelling them."""

TIMED_OPERATIONS: Final = {
    MessageType.LOOKUP: "lookup",
    MessageType.PREFETCH: "prefetch",
    MessageType.STORE: "store",
    MessageType.COMMIT: "commit",
    MessageType.RETRIEVE: "retrieve",
}
"""Requests whose time in the server is tracked (STATS latencies, Prometheus histogram):
``store`` hashes and allocates, ``commit`` caches what the client copied in."""

_LOOPBACK_NAMES: Final = frozenset({"localhost", "ip6-localhost"})
_INLINE_COPY_BYTES: Final = 4 << 20  # bigger inline payloads are copied in a worker thread
_SHM_DIR: Final = "/dev/shm"

_Reply: TypeAlias = tuple[dict[str, Any], Sequence[object]]
_Handler: TypeAlias = Callable[["_Session | None", Message], Awaitable["_Reply | None"]]
_NowHandler: TypeAlias = Callable[["_Session | None", Message], "dict[str, Any] | None"]


def default_endpoint() -> str:
    """``ipc://{tempdir}/lmcache-async-sidecar-{uid}.sock``: one sidecar per user."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return f"ipc://{os.path.join(tempfile.gettempdir(), f'lmcache-async-sidecar-{uid}.sock')}"


def check_listen_url(url: str, *, allow_remote: bool = False) -> str:
    """Validate a listen address: ``ipc://PATH`` or ``tcp://HOST:PORT``.

    A tcp address must name a loopback host (``127.0.0.1``, ``::1``, ``localhost``) unless
    ``allow_remote``: a wider bind exposes the cache (and ``clear``/``shutdown``) to the
    network, so it has to be asked for explicitly (and should use CURVE keys).

    Raises:
        ConfigError: ``field="listen"`` naming what is wrong.
    """
    if not isinstance(url, str):
        raise ConfigError("listen", f"expected a URL string, got {type(url).__name__}")
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("ipc", "tcp"):
        raise ConfigError("listen", f"expected ipc://PATH or tcp://HOST:PORT, got {url!r}")
    if scheme == "ipc":
        if not rest:
            raise ConfigError("listen", "ipc:// needs a socket path")
        if len(os.fsencode(rest)) > 107:
            raise ConfigError("listen", f"socket path {rest!r} is longer than 107 bytes")
        return url
    host, colon, port = rest.rpartition(":")
    host = host.strip("[]")
    if not colon or not host or not (port.isdigit() or port == "*"):
        raise ConfigError("listen", f"expected tcp://HOST:PORT, got {url!r}")
    if not allow_remote and not _is_loopback(host):
        raise ConfigError(
            "listen",
            f"{url!r} binds beyond loopback; pass --allow-remote to serve other hosts "
            "(and --curve-secret-key-file to encrypt and authenticate the traffic)",
        )
    return url


def _is_loopback(host: str) -> bool:
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def boot_id() -> str | None:
    """This machine's boot id (Linux), which with the host name tells "same host" apart."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip() or None
    except OSError:
        return None


def load_curve_secret_key(path: str) -> bytes:
    """The z85 CURVE secret key in ``path``: a ZeroMQ certificate file (``secret-key =
    "..."``, as ``zmq.auth.create_certificates`` writes) or a file holding just the key.

    Raises:
        ConfigError: ``field="curve_secret_key_file"``: unreadable, or no secret key.
    """
    field_name = "curve_secret_key_file"
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ConfigError(field_name, f"cannot read {path!r}: {exc.strerror}") from exc
    key: bytes | None = None
    stripped = text.strip()
    if len(stripped) == 40 and "\n" not in stripped:
        key = stripped.encode("ascii", "replace")
    else:
        from zmq.auth import load_certificate  # noqa: PLC0415  (certificate files only)

        try:
            _, key = load_certificate(path)
        except (ValueError, OSError):
            key = None
    if not key or len(key) != 40:
        raise ConfigError(field_name, f"{path!r} holds no 40-character z85 CURVE secret key")
    try:
        zmq.curve_public(key)
    except (zmq.ZMQError, ValueError) as exc:
        raise ConfigError(field_name, f"{path!r}: invalid CURVE secret key: {exc}") from exc
    return key


@dataclass(frozen=True, slots=True)
class SidecarNamespace:
    """What one sidecar serves: a model (with weights revision and tenant) and KV layout.

    Two namespaces match when the model, revision and tenant are equal and the layouts have
    the same fingerprint (block size and memory order may differ: the payloads do not).
    """

    model_name: str
    layout: KVLayout
    revision: str | None = None
    tenant: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model_name, str) or not self.model_name:
            raise InvalidInputError("model_name must be a non-empty string")
        if not isinstance(self.layout, KVLayout):
            raise InvalidInputError("layout must be a KVLayout")
        for name in ("revision", "tenant"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise InvalidInputError(f"{name} must be a str or None, got {value!r:.40}")

    @classmethod
    def from_wire(cls, header: dict[str, Any]) -> SidecarNamespace:
        """The namespace a HELLO header asks for.

        Raises:
            InvalidInputError: a field is missing or malformed.
        """
        return cls(
            model_name=header.get("model_name"),  # type: ignore[arg-type]
            layout=KVLayout.from_dict(header.get("layout")),
            revision=header.get("revision"),
            tenant=header.get("tenant"),
        )

    def to_wire(self) -> dict[str, Any]:
        return {
            "model_name": self.model_name,
            "revision": self.revision,
            "tenant": self.tenant,
            "layout": self.layout.to_dict(),
        }

    def mismatch(self, other: SidecarNamespace) -> str | None:
        """Why ``other`` cannot be served by a sidecar serving this one (None: it can)."""
        differences = [
            f"{name} {getattr(other, name)!r} (served: {getattr(self, name)!r})"
            for name in ("model_name", "revision", "tenant")
            if getattr(self, name) != getattr(other, name)
        ]
        if self.layout.fingerprint != other.layout.fingerprint:
            differences.append(
                f"layout {other.layout.fingerprint!r} (served: {self.layout.fingerprint!r})"
            )
        return "; ".join(differences) or None


@dataclass(frozen=True, slots=True)
class SidecarSettings:
    """How :func:`serve` runs.

    ``client_timeout`` defaults to five heartbeat intervals. ``namespace`` opens the
    engine at start instead of at the first HELLO.

    Raises:
        ConfigError: a setting is invalid; ``.field`` names it.
    """

    listen: str = field(default_factory=default_endpoint)
    config: EngineConfig = field(default_factory=EngineConfig)
    namespace: SidecarNamespace | None = None
    heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL
    client_timeout: float | None = None
    allow_remote: bool = False
    curve_secret_key: bytes | None = None
    limits: MessageLimits = DEFAULT_SIDECAR_LIMITS
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY
    events: str | None = None
    """Where KV events are published (a PUB socket's ``ipc://`` or ``tcp://`` URL, loopback
    unless ``allow_remote``); None: not published."""
    metrics_port: int | None = None
    """Port of the Prometheus endpoint on loopback (0: any free one); None: no endpoint."""

    def __post_init__(self) -> None:
        check_listen_url(self.listen, allow_remote=self.allow_remote)
        if self.events is not None:
            try:
                check_listen_url(self.events, allow_remote=self.allow_remote)
            except ConfigError as exc:
                raise ConfigError("events", str(exc).removeprefix("listen: ")) from None
        if self.metrics_port is not None and (
            not is_strict_int(self.metrics_port) or not 0 <= self.metrics_port <= 65535
        ):
            raise ConfigError("metrics_port", f"expected a port number: {self.metrics_port!r}")
        if not isinstance(self.config, EngineConfig):
            raise ConfigError("config", "expected an EngineConfig")
        for name in ("heartbeat_interval", "client_timeout"):
            value = getattr(self, name)
            if value is None and name == "client_timeout":
                continue
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value <= 0
            ):
                raise ConfigError(name, f"expected a positive number of seconds, got {value!r}")
        if not is_strict_int(self.max_concurrency) or self.max_concurrency <= 0:
            raise ConfigError("max_concurrency", f"expected a positive int: {self.max_concurrency}")
        if self.namespace is not None and not isinstance(self.namespace, SidecarNamespace):
            raise ConfigError("namespace", "expected a SidecarNamespace")

    @property
    def session_timeout(self) -> float:
        """Seconds after which a silent client's session is dropped."""
        if self.client_timeout is not None:
            return float(self.client_timeout)
        return DEFAULT_CLIENT_TIMEOUT_BEATS * self.heartbeat_interval


@dataclass(eq=False, slots=True)
class _Transaction:
    """Payloads lent to one client between a STORE and its COMMIT, or a RETRIEVE and its
    RELEASE. It owns one reference on each object in ``objs`` and ``held``."""

    txn_id: int
    kind: MessageType
    deadline: float
    spans: list[ChunkSpan]
    objs: list[MemoryObj] = field(default_factory=list)
    todo: list[int] = field(default_factory=list)  # store: the span index of each obj
    held: list[MemoryObj] = field(default_factory=list)  # store: chunks already cached
    stored: list[bool] = field(default_factory=list)  # store: per span
    tokens: np.ndarray | None = None
    locations: list[str] | None = None
    partial: bool = False

    def stored_tokens(self) -> int:
        """Tokens covered by the leading run of cached chunks (as a store counts them)."""
        if not self.spans:
            return 0
        end = self.spans[0].start
        for span, ok in zip(self.spans, self.stored, strict=False):
            if not ok:
                break
            end = span.end
        return end - self.spans[0].start

    def release(self) -> None:
        for obj in (*self.objs, *self.held):
            obj.unref()
        self.objs.clear()
        self.held.clear()


@dataclass(eq=False, slots=True)
class _Session:
    """One connected client (one ROUTER identity)."""

    identity: bytes
    label: str
    last_seen: float
    transactions: dict[int, _Transaction] = field(default_factory=dict)
    lookup_ids: set[int | str] = field(default_factory=set)

    def scoped(self, lookup_id: int | str) -> tuple[str, bytes, int | str]:
        """The engine-side lookup id: a client's ids never meet another client's."""
        return ("sidecar", self.identity, lookup_id)


@dataclass(frozen=True, slots=True)
class _Route:
    handler: _Handler
    needs_session: bool
    needs_engine: bool
    now: _NowHandler | None = None
    """Answers the request at once, in the socket's reader callback (a reply header, no
    payloads), or returns None when it must wait: ``handler`` then serves it in a task."""


@dataclass(eq=False, slots=True)
class _Opening:
    """A request to the engine host task: open the engine for ``namespace``."""

    namespace: SidecarNamespace
    done: anyio.Event = field(default_factory=anyio.Event)
    error: BaseException | None = None


class SidecarServer:
    """The request handlers and session bookkeeping of one sidecar; :func:`serve` runs it.

    Message types map to handlers in one table (:meth:`_routes`), each saying whether it
    needs a session and an open engine, so new operations are one method and one entry.
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
        self._buffer: memoryview | None = segment.buf
        self.instance = secrets.token_hex(8)
        self._started = time.monotonic()
        self._host = socketlib.gethostname()
        self._boot_id = boot_id()
        self._sessions: dict[bytes, _Session] = {}
        self._txn_ids = itertools.count(1)
        self._engine: CacheEngine | None = None
        self._namespace: SidecarNamespace | None = None
        self._open_lock = anyio.Lock()
        self._openings_send, self._openings = anyio.create_memory_object_stream[_Opening](1)
        self._close_engine = anyio.Event()
        self._engine_closed = anyio.Event()
        self.stopping = anyio.Event()
        self._free_slots = settings.max_concurrency
        self._io: LoopSocket | None = None
        self._inflight = 0
        self._idle = anyio.Event()
        self._idle.set()
        self._routes: dict[MessageType, _Route] = self._route_table()
        # The routes that may answer in the reader callback, by their raw type frame.
        self._now_routes = {
            bytes((int(kind),)): route for kind, route in self._routes.items() if route.now
        }
        self.latency = LatencyTracker(tuple(TIMED_OPERATIONS.values()))
        self.publisher: EventPublisher | None = None
        self.metrics: MetricsServer | None = None

    def _route_table(self) -> dict[MessageType, _Route]:
        return {
            MessageType.HELLO: _Route(self._on_hello, needs_session=False, needs_engine=False),
            MessageType.HEARTBEAT: _Route(self._on_heartbeat, True, False, self._heartbeat_now),
            MessageType.PING: _Route(self._on_ping, False, False, self._ping_now),
            MessageType.LOOKUP: _Route(self._on_lookup, True, True, self._lookup_now),
            MessageType.PREFETCH: _Route(self._on_prefetch, True, True),
            MessageType.UNPIN: _Route(self._on_unpin, True, True),
            MessageType.STORE: _Route(self._on_store, True, True),
            MessageType.COMMIT: _Route(self._on_commit, True, True),
            MessageType.RETRIEVE: _Route(self._on_retrieve, True, True),
            MessageType.RELEASE: _Route(self._on_release, True, True),
            MessageType.CLEAR: _Route(self._on_clear, False, True),
            MessageType.FREEZE: _Route(self._on_freeze, False, True),
            MessageType.HOT_CACHE: _Route(self._on_hot_cache, False, True),
            MessageType.STATS: _Route(self._on_stats, False, False),
            MessageType.HEALTH: _Route(self._on_health, False, False),
            MessageType.SHUTDOWN: _Route(self._on_shutdown, False, False),
            MessageType.PUSH: _Route(self._on_push, True, True),
            MessageType.MOVE: _Route(self._on_move, False, True),
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
        return self._engine

    def info(self) -> dict[str, Any]:
        """The server's own state, for STATS replies."""
        return {
            "instance": self.instance,
            "endpoint": self.endpoint,
            "pid": os.getpid(),
            "shm": self._segment.name,
            "shm_bytes": self._segment.size,
            "sessions": len(self._sessions),
            "transactions": sum(len(s.transactions) for s in self._sessions.values()),
            "session_lookup_ids": sum(len(s.lookup_ids) for s in self._sessions.values()),
            "namespace": None if self._namespace is None else self._namespace.to_wire(),
        }

    # -- the engine ---------------------------------------------------------------------

    async def open_engine(self, namespace: SidecarNamespace) -> CacheEngine:
        """The engine for ``namespace``, opened by the first caller.

        Raises:
            InvalidInputError: another namespace is served (the message names the
                differences), or the engine cannot open with these settings (ConfigError).
        """
        async with self._open_lock:
            if self._engine is None:
                opening = _Opening(namespace)
                await self._openings_send.send(opening)
                await opening.done.wait()
                if opening.error is not None:
                    raise opening.error
            assert self._engine is not None and self._namespace is not None
            why = self._namespace.mismatch(namespace)
            if why is not None:
                raise InvalidInputError(f"namespace mismatch: this sidecar cannot serve {why}")
            return self._engine

    async def host_engine(self) -> None:
        """Open the engine when asked (:meth:`open_engine`) and keep it open until
        :meth:`close_engine`; the engine is entered and left in this one task."""
        try:
            async with self._openings:
                async for opening in self._openings:
                    ns = opening.namespace
                    try:
                        async with CacheEngine.open(
                            self.settings.config,
                            ns.layout,
                            model_name=ns.model_name,
                            revision=ns.revision,
                            tenant=ns.tenant,
                            pool_buffer=self._buffer,
                        ) as engine:
                            self._engine, self._namespace = engine, ns
                            opening.done.set()
                            log.info(
                                "sidecar_namespace_fixed",
                                model=ns.model_name,
                                layout=ns.layout.fingerprint,
                            )
                            await self._serve_engine(engine)
                            await self._end_sessions("shutdown")
                        return
                    except Exception as exc:
                        if opening.done.is_set():
                            raise
                        log.warning("sidecar_engine_open_failed", error=str(exc))
                        # Without its frames: they hold the half-built engine's arena view,
                        # which would keep the segment from being closed.
                        opening.error = exc.with_traceback(None)
                        opening.done.set()
                    finally:
                        self._engine = None
        finally:
            self._engine_closed.set()

    async def _serve_engine(self, engine: CacheEngine) -> None:
        """Publish the engine's KV events (with a publisher) until the engine is to close."""
        async with anyio.create_task_group() as task_group:
            if self.publisher is not None:
                source = engine_event_source(engine)
                task_group.start_soon(self.publisher.publish_from, source, name="sidecar-events")
            await self._close_engine.wait()
            task_group.cancel_scope.cancel()

    def collector(self) -> EngineCollector:
        """A Prometheus collector of the engine's stats, request latencies and sessions."""

        def stats() -> EngineStats | None:
            engine = self._engine
            return None if engine is None else engine.stats()

        def extra() -> dict[str, float]:
            gauges = {
                "sidecar_sessions": float(len(self._sessions)),
                "sidecar_transactions": float(
                    sum(len(s.transactions) for s in self._sessions.values())
                ),
            }
            if self.publisher is not None:
                gauges["kv_event_subscribers"] = float(self.publisher.subscribers)
                gauges["kv_events_published"] = float(self.publisher.published)
            return gauges

        return EngineCollector(stats, latency=self.latency, extra=extra)

    async def close_engine(self) -> None:
        """End every session and close the engine (flushing queued tier writes)."""
        self._close_engine.set()
        self._openings_send.close()
        await self._engine_closed.wait()

    def release_buffer(self) -> None:
        self._buffer = None

    # -- sessions -----------------------------------------------------------------------

    async def _end_sessions(self, reason: str) -> None:
        for session in list(self._sessions.values()):
            await self._drop_session(session, reason)

    async def _drop_session(self, session: _Session, reason: str) -> None:
        """Forget a client: end its transactions and release its lookup pins."""
        self._sessions.pop(session.identity, None)
        for txn in session.transactions.values():
            txn.release()
        engine = self._engine
        if engine is not None:
            for lookup_id in session.lookup_ids:
                with contextlib.suppress(EngineClosedError):
                    await engine.lookup_unpin(session.scoped(lookup_id))
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
        """Drop sessions silent for ``session_timeout`` and transactions past their
        deadline, checking twice per heartbeat interval."""
        timeout = self.settings.session_timeout
        period = min(self.settings.heartbeat_interval, timeout) / 2
        while True:
            await anyio.sleep(period)
            now = time.monotonic()
            for session in list(self._sessions.values()):
                if now - session.last_seen > timeout:
                    await self._drop_session(session, "timeout")
                    continue
                for txn_id, txn in list(session.transactions.items()):
                    if txn.deadline <= now:
                        del session.transactions[txn_id]
                        txn.release()
                        log.warning("sidecar_transaction_expired", client=session.label)

    # -- the socket ---------------------------------------------------------------------

    async def receive(self) -> None:
        """Read requests and serve each in a task of its own, until cancelled; then the
        requests still running are cancelled and waited for.

        Requests are read in the event loop's reader callback (:class:`LoopSocket`) and run
        as plain asyncio tasks rather than in an anyio task group: on a small machine
        ``start_soon`` costs about 50 us a task against 9 us for ``create_task``, a large
        share of a lookup's round trip. At ``max_concurrency`` requests in flight, reading
        pauses (requests wait in ZeroMQ's bounded queue) until one finishes.
        """
        loop = asyncio.get_running_loop()
        tasks: set[asyncio.Task[None]] = set()

        def on_message(frames: list[zmq.Frame]) -> None:
            # A client whose requests wait for a slot is alive: keep its session, and
            # let heartbeats and pings through without one, so a server busy with
            # slow stores never lets its clients' sessions time out.
            identity = frames[0].bytes
            session = self._sessions.get(identity)
            if session is not None:
                session.last_seen = time.monotonic()
            if self._answered_now(session, frames):
                return
            slot = not _is_probe(frames)
            if slot:
                self._free_slots -= 1
                if self._free_slots <= 0:
                    io.pause()
            self._inflight += 1
            self._idle = anyio.Event() if self._idle.is_set() else self._idle
            task = loop.create_task(self._handle(identity, frames, slot))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

        io = LoopSocket(self._socket, on_message)
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

    def _answered_now(self, session: _Session | None, frames: Sequence[FrameLike]) -> bool:
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
            or (route.needs_engine and self._engine is None)
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
        except (ProtocolError, InvalidInputError, EngineClosedError):
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

    async def _handle(self, identity: bytes, frames: Sequence[FrameLike], slot: bool) -> None:
        try:
            reply = await self._answer(identity, frames[1:])
            io = self._io
            if reply is None or io is None:
                return
            _send_reply(io, frames[0], reply)
        except Exception:  # a plain task: nobody else would see it
            log.exception("sidecar_handler_failed")
        finally:
            if slot:
                self._free_slots += 1
                if self._io is not None:
                    self._io.resume()
            self._inflight -= 1
            if not self._inflight:
                self._idle.set()

    async def _answer(
        self, identity: bytes, body: Sequence[FrameLike]
    ) -> list[bytes | memoryview] | None:
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
        session = self._sessions.get(identity)
        if session is not None:
            session.last_seen = time.monotonic()
        if message.type is MessageType.HELLO:
            session = self._sessions.get(identity) or _Session(identity, "", time.monotonic())
        elif route.needs_session and session is None:
            return error_reply(
                request_id, ErrorCode.NO_SESSION, "no session: say HELLO (again) first"
            )
        if route.needs_engine and self._engine is None:
            return error_reply(
                request_id, ErrorCode.ENGINE_CLOSED, "no engine yet: no client has said HELLO"
            )
        operation = TIMED_OPERATIONS.get(message.type)
        started = time.perf_counter()
        try:
            result = await route.handler(session, message)
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
        return encode(message.type, header, payloads, request_id=request_id)

    def _need_engine(self) -> CacheEngine:
        engine = self._engine
        if engine is None:
            raise EngineClosedError("the sidecar's engine is closed")
        return engine

    # -- handlers: session ----------------------------------------------------------------

    async def _on_hello(self, session: _Session | None, message: Message) -> _Reply:
        assert session is not None
        header = message.header
        namespace = SidecarNamespace.from_wire(header)
        engine = await self.open_engine(namespace)
        label = header.get("client")
        session.label = label if isinstance(label, str) else session.identity.hex()
        session.last_seen = time.monotonic()
        self._sessions[session.identity] = session
        host, boot = header.get("host"), header.get("boot_id")
        same_host = self.endpoint.startswith("ipc://") or (
            host == self._host and boot is not None and boot == self._boot_id
        )
        log.info("sidecar_client_hello", client=session.label, shared_memory=same_host)
        config = engine.config
        reply = {
            "server": self.instance,
            "pid": os.getpid(),
            "shm": self._segment.name if same_host else None,
            "shm_bytes": self._segment.size,
            "chunk_size": config.chunk_size,
            "save_unfull_chunk": config.save_unfull_chunk,
            "heartbeat_interval": self.settings.heartbeat_interval,
            "client_timeout": self.settings.session_timeout,
            "max_payload_bytes": self.settings.limits.max_payload_bytes,
            "tiers": list(engine.stats().tiers),
            "namespace": (self._namespace or namespace).to_wire(),
            # Enough for a client to compute chunk keys itself and look up by digests.
            "hash_algorithm": engine.key_hasher.algorithm.value,
            "key_seed": engine.key_hasher.seed,
        }
        return reply, ()

    async def _on_heartbeat(self, session: _Session | None, message: Message) -> _Reply:
        return self._heartbeat_now(session, message), ()

    def _heartbeat_now(self, session: _Session | None, message: Message) -> dict[str, Any]:
        engine = self._engine
        return {"server": self.instance, "healthy": engine is not None and engine.is_healthy()}

    async def _on_ping(self, session: _Session | None, message: Message) -> _Reply:
        return self._ping_now(session, message), ()

    def _ping_now(self, session: _Session | None, message: Message) -> dict[str, Any]:
        return {"server": self.instance}

    # -- handlers: lookups ----------------------------------------------------------------

    def _lookup_now(self, session: _Session | None, message: Message) -> dict[str, Any] | None:
        """A LOOKUP by chunk digests that the engine answers without waiting (its CPU tier
        suffices); None for any other."""
        assert session is not None
        engine, header = self._engine, message.header
        if engine is None or "digests_of" not in header or "search_range" in header:
            return None
        pin, lookup_id, scoped = _pin_fields(session, header)
        hits = engine.lookup_digests_now(
            _digests(message), _int(header, "digests_of", -1), lookup_id=scoped, pin=pin
        )
        if hits is None:
            return None
        if pin and lookup_id is not None:
            session.lookup_ids.add(lookup_id)
        return {"hits": hits}

    async def _on_lookup(self, session: _Session | None, message: Message) -> _Reply:
        assert session is not None
        engine = self._need_engine()
        header = message.header
        pin, lookup_id, scoped = _pin_fields(session, header)
        search_range = _locations(header, "search_range")
        if "digests_of" in header:
            # The client hashed the prompt: one frame of DIGEST_SIZE-byte chunk digests.
            num_tokens = _int(header, "digests_of", -1)
            digests = _digests(message)
            if pin and lookup_id is not None:
                session.lookup_ids.add(lookup_id)
            hits = await engine.lookup_digests(
                digests, num_tokens, lookup_id=scoped, pin=pin, search_range=search_range
            )
            return {"hits": hits}, ()
        tokens, hashes, offsets = _key_input(message)
        if pin and lookup_id is not None:
            session.lookup_ids.add(lookup_id)
        hits = await engine.lookup(
            tokens,
            hashes=hashes,
            offsets=offsets,
            lookup_id=scoped,
            pin=pin,
            search_range=search_range,
        )
        return {"hits": hits}, ()

    async def _on_prefetch(self, session: _Session | None, message: Message) -> _Reply:
        assert session is not None
        engine = self._need_engine()
        header = message.header
        lookup_id = _lookup_id(header, required=True)
        assert lookup_id is not None
        tokens, hashes, offsets = _key_input(message)
        session.lookup_ids.add(lookup_id)
        hits = await engine.prefetch(
            tokens,
            lookup_id=session.scoped(lookup_id),
            hashes=hashes,
            offsets=offsets,
            search_range=_locations(header, "search_range"),
        )
        return {"hits": hits}, ()

    async def _on_unpin(self, session: _Session | None, message: Message) -> _Reply:
        assert session is not None
        lookup_id = _lookup_id(message.header, required=True)
        assert lookup_id is not None
        session.lookup_ids.discard(lookup_id)
        await self._need_engine().lookup_unpin(session.scoped(lookup_id))
        return {}, ()

    # -- handlers: store ------------------------------------------------------------------

    async def _spans(
        self, engine: CacheEngine, message: Message
    ) -> tuple[list[ChunkSpan], np.ndarray | None]:
        """The request's chunks from its ``start`` (the mask's first True) on."""
        start = _int(message.header, "start", 0)
        if start % engine.config.chunk_size:
            raise InvalidInputError(
                f"the mask must start on a chunk boundary (chunk_size "
                f"{engine.config.chunk_size}), got {start}"
            )
        tokens, hashes, offsets = _key_input(message)
        spans, array = await engine.chunk_spans(tokens, hashes=hashes, offsets=offsets)
        if start:
            spans = [span for span in spans if span.start >= start]
        return spans, array

    async def _on_store(self, session: _Session | None, message: Message) -> _Reply:
        assert session is not None
        engine = self._need_engine()
        header = message.header
        locations = _locations(header, "store_location")
        spans, tokens = await self._spans(engine, message)
        if not engine.accepts_writes:
            engine.record_request("store", 0)
            return {"stored": 0}, ()
        limit = header.get("limit")
        if limit is not None:
            limit = _int(header, "limit", 0)
            spans = [span for span in spans if span.end <= limit]
        present = engine.hold_chunks([span.key for span in spans])
        txn = _Transaction(
            next(self._txn_ids),
            MessageType.STORE,
            _deadline(message.header, engine.config.store_timeout),
            spans,
            stored=[obj is not None for obj in present],
            held=[obj for obj in present if obj is not None],
            tokens=tokens,
            locations=locations,
        )
        try:
            for index, obj in enumerate(present):
                if obj is not None:
                    continue
                try:
                    payload = await engine.allocate_chunk(spans[index].num_tokens)
                except AllocationTimeoutError:
                    txn.partial = True
                    log.warning("store_partial", client=session.label, stored_chunks=index)
                    break
                txn.objs.append(payload)
                txn.todo.append(index)
        except BaseException:
            txn.release()
            raise
        if not txn.objs:
            stored = txn.stored_tokens()
            txn.release()
            engine.record_request("store", stored, partial=txn.partial)
            return {"stored": stored}, ()
        session.transactions[txn.txn_id] = txn
        chunks = [
            [spans[i].start, spans[i].end, engine.buffer_offset(obj), obj.nbytes]
            for i, obj in zip(txn.todo, txn.objs, strict=True)
        ]
        return {"txn": txn.txn_id, "chunks": chunks}, ()

    def _take(self, session: _Session, message: Message, kind: MessageType) -> _Transaction | None:
        """End the session's transaction named in the message (None: it expired)."""
        txn_id = message.header.get("txn")
        if not isinstance(txn_id, int) or isinstance(txn_id, bool):
            raise ProtocolError("'txn' must be an int")
        txn = session.transactions.get(txn_id)
        if txn is None or txn.kind is not kind:
            log.warning("sidecar_transaction_unknown", client=session.label, kind=kind.name)
            return None
        del session.transactions[txn_id]
        return txn

    async def _on_commit(self, session: _Session | None, message: Message) -> _Reply:
        assert session is not None
        engine = self._need_engine()
        txn = self._take(session, message, MessageType.STORE)
        if txn is None:
            engine.record_request("store", 0)
            return {"stored": 0, "expired": True}, ()
        try:
            if _flag(message.header, "abort"):
                engine.record_request("store", 0)
                return {"stored": 0}, ()
            if message.payloads:
                await self._fill(engine, txn, message.payloads)
            spans = [txn.spans[i] for i in txn.todo]
            kept = await engine.put_chunks(
                spans, txn.objs, txn.tokens, store_location=txn.locations
            )
            cached = engine.hold_chunks([span.key for span in spans[:kept]])
            for index, obj in zip(txn.todo[:kept], cached, strict=True):
                txn.stored[index] = True
                if obj is not None:
                    txn.held.append(obj)
            stored = txn.stored_tokens()
            engine.record_request("store", stored, partial=txn.partial)
            return {"stored": stored}, ()
        finally:
            txn.release()

    async def _fill(
        self, engine: CacheEngine, txn: _Transaction, payloads: list[memoryview]
    ) -> None:
        """Copy inline payload frames (a client on another host) into the payloads."""
        if len(payloads) != len(txn.objs):
            raise ProtocolError(
                f"the commit carries {len(payloads)} payloads for {len(txn.objs)} chunks"
            )
        arena = np.frombuffer(self._need_buffer(), dtype=np.uint8)
        jobs: list[tuple[np.ndarray, np.ndarray]] = []
        for index, (obj, payload) in enumerate(zip(txn.objs, payloads, strict=True)):
            if payload.nbytes != obj.nbytes:
                raise ProtocolError(
                    f"payload {index} holds {payload.nbytes} bytes, the chunk {obj.nbytes}"
                )
            offset = engine.buffer_offset(obj)
            jobs.append((arena[offset : offset + obj.nbytes], np.frombuffer(payload, np.uint8)))

        def copy() -> None:
            for dst, src in jobs:
                dst[:] = src

        if sum(obj.nbytes for obj in txn.objs) < _INLINE_COPY_BYTES:
            copy()
        else:
            await anyio.to_thread.run_sync(copy)

    def _need_buffer(self) -> memoryview:
        if self._buffer is None:
            raise EngineClosedError("the sidecar's shared memory is released")
        return self._buffer

    # -- handlers: retrieve ---------------------------------------------------------------

    async def _on_retrieve(self, session: _Session | None, message: Message) -> _Reply:
        assert session is not None
        engine = self._need_engine()
        header = message.header
        locations = _locations(header, "retrieve_locations")
        lookup_id = _lookup_id(header, required=False)
        scoped = None if lookup_id is None else session.scoped(lookup_id)
        try:
            spans, _ = await self._spans(engine, message)
            objs = await engine.fetch_chunks(
                [span.key for span in spans], lookup_id=scoped, retrieve_locations=locations
            )
        finally:
            if lookup_id is not None and scoped is not None:
                session.lookup_ids.discard(lookup_id)
                await engine.lookup_unpin(scoped)
        if not objs:
            engine.record_request("retrieve", 0)
            return {"chunks": []}, ()
        spans = spans[: len(objs)]
        txn = _Transaction(
            next(self._txn_ids),
            MessageType.RETRIEVE,
            _deadline(message.header, engine.config.retrieve_timeout),
            spans,
            objs=objs,
        )
        session.transactions[txn.txn_id] = txn
        offsets = [engine.buffer_offset(obj) for obj in objs]
        chunks = [
            [span.start, span.end, offset, obj.nbytes]
            for span, obj, offset in zip(spans, objs, offsets, strict=True)
        ]
        payloads: list[memoryview] = []
        if _flag(header, "inline"):
            buffer = self._need_buffer()
            payloads = [
                buffer[offset : offset + obj.nbytes]
                for obj, offset in zip(objs, offsets, strict=True)
            ]
        return {"txn": txn.txn_id, "chunks": chunks}, payloads

    async def _on_release(self, session: _Session | None, message: Message) -> None:
        assert session is not None
        txn = self._take(session, message, MessageType.RETRIEVE)
        if txn is None:
            return
        txn.release()
        loaded = message.header.get("loaded", 0)
        if is_strict_int(loaded) and loaded >= 0:
            self._need_engine().record_request("retrieve", loaded)

    # -- handlers: moves between instances ------------------------------------------------

    async def _on_push(self, session: _Session | None, message: Message) -> _Reply:
        """Cache chunks another instance pushed inline, each verified against its checksum
        first; the leading run that passes is cached, the rest refused and not counted."""
        assert session is not None
        engine = self._need_engine()
        header = message.header
        if "hashes" in header or not message.payloads:
            raise ProtocolError("a push carries a token frame, then the chunk payloads")
        frames = message.payloads[1:]
        checksums = _checksums(header, len(frames))
        locations = _locations(header, "store_location")
        spans, tokens = await self._spans(engine, message)
        if not engine.accepts_writes:
            engine.record_request("store", 0)
            return {"stored": 0, "chunks": 0, "refused": len(frames)}, ()
        objs: list[MemoryObj] = []
        try:
            for index, (span, frame) in enumerate(zip(spans, frames, strict=False)):
                try:
                    obj = await engine.allocate_chunk(span.num_tokens)
                except AllocationTimeoutError:
                    log.warning("push_partial", client=session.label, taken_chunks=index)
                    break
                if frame.nbytes != obj.nbytes:
                    obj.unref()
                    log.warning(
                        "push_chunk_refused",
                        client=session.label,
                        chunk=index,
                        reason=f"{frame.nbytes} bytes, the chunk holds {obj.nbytes}",
                    )
                    break
                objs.append(obj)
            good = await self._verify(engine, objs, frames, checksums)
            if good < len(objs):
                log.warning(
                    "push_chunk_refused", client=session.label, chunk=good, reason="bad checksum"
                )
                for obj in objs[good:]:
                    obj.unref()
                del objs[good:]
            kept = 0
            if objs:
                kept = await engine.put_chunks(
                    spans[: len(objs)], objs, tokens, store_location=locations
                )
            if kept:
                await self._flush_push(engine, header)
        finally:
            for obj in objs:
                obj.unref()
        stored = spans[kept - 1].end - spans[0].start if kept else 0
        engine.record_request("store", stored, partial=kept < len(frames))
        return {"stored": stored, "chunks": kept, "refused": len(frames) - kept}, ()

    async def _verify(
        self,
        engine: CacheEngine,
        objs: list[MemoryObj],
        frames: list[memoryview],
        checksums: list[int],
    ) -> int:
        """Copy each frame into its payload and check the copy against its checksum (kept
        on the object); returns how many leading payloads passed."""
        arena = np.frombuffer(self._need_buffer(), dtype=np.uint8)
        jobs = [
            (
                arena[engine.buffer_offset(obj) : engine.buffer_offset(obj) + obj.nbytes],
                np.frombuffer(frame, dtype=np.uint8),
            )
            for obj, frame in zip(objs, frames, strict=False)
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
            return verify()
        return await anyio.to_thread.run_sync(verify)

    async def _flush_push(self, engine: CacheEngine, header: dict[str, Any]) -> None:
        """Wait for queued disk and Redis writes, within half the pusher's patience, so
        what a push reports is written (a move may delete its source next)."""
        wait = _seconds(header, "timeout")
        limit = engine.config.store_timeout if wait is None else wait / 2
        if not await engine.flush(limit):
            log.warning("push_flush_timed_out", seconds=limit)

    async def _on_move(self, session: _Session | None, message: Message) -> _Reply:
        engine = self._need_engine()
        header = message.header
        if len(message.payloads) != 1:
            raise ProtocolError("a move carries exactly one token frame")
        tokens = tokens_from_payload(message.payloads[0])
        # Both positions are checked by the engine, which names what is wrong.
        old_position: Any = header.get("old_position")
        new_position: Any = header.get("new_position")
        copy = _flag(header, "copy", required=True)
        moved = await engine.move(
            tokens, old_position, new_position, copy, timeout=_seconds(header, "timeout")
        )
        return {"moved": moved}, ()

    # -- handlers: administration ---------------------------------------------------------

    async def _on_clear(self, session: _Session | None, message: Message) -> _Reply:
        dropped = await self._need_engine().clear(_locations(message.header, "locations"))
        return {"chunks": dropped}, ()

    async def _on_freeze(self, session: _Session | None, message: Message) -> _Reply:
        enabled = _flag(message.header, "enabled", required=True)
        self._need_engine().freeze(enabled)
        return {"enabled": enabled}, ()

    async def _on_hot_cache(self, session: _Session | None, message: Message) -> _Reply:
        enabled = _flag(message.header, "enabled", required=True)
        self._need_engine().set_hot_cache(enabled)
        return {"enabled": enabled}, ()

    async def _on_stats(self, session: _Session | None, message: Message) -> _Reply:
        engine = self._engine
        stats = None if engine is None else to_wire(engine.stats())
        uptime = time.monotonic() - self._started
        reply = {
            "stats": stats,
            "server": self.info(),
            "uptime_s": uptime,
            "latency": to_wire(self.latency.summaries()),
            "events": None if self.publisher is None else self.publisher.info(),
            "metrics": None if self.metrics is None else self.metrics.url,
        }
        return reply, ()

    async def _on_health(self, session: _Session | None, message: Message) -> _Reply:
        engine = self._engine
        if engine is None:
            return {"healthy": True, "tiers": {}, "engine": False}, ()
        tiers = await engine.check_health()  # probe now: the caller asks for the state now
        return {"healthy": engine.is_healthy(), "tiers": to_wire(tiers)}, ()

    async def _on_shutdown(self, session: _Session | None, message: Message) -> _Reply:
        log.info("sidecar_shutdown_requested")
        self.stopping.set()
        return {}, ()


# -- header fields ---------------------------------------------------------------------------


_PROBES: Final = frozenset({MessageType.HEARTBEAT, MessageType.PING})


def _is_probe(frames: Sequence[FrameLike]) -> bool:
    """Whether a raw message is a heartbeat or a ping (answered without a request slot)."""
    if len(frames) < 2:
        return False
    kind = _frame_bytes(frames[1])
    return len(kind) == 1 and kind[0] in _PROBES


def _send_reply(io: LoopSocket, identity: FrameLike, reply: Sequence[FrameLike]) -> None:
    """Queue a reply to the client ``identity`` names (logged, not raised, when it fails)."""
    try:
        if not io.send_nowait([identity, *reply], copy=False):
            log.warning("sidecar_reply_dropped", reason="the client's queue is full")
    except zmq.ZMQError as exc:
        if not io.closed:
            log.warning("sidecar_reply_failed", error=str(exc))


def _pin_fields(
    session: _Session, header: dict[str, Any]
) -> tuple[bool, int | str | None, tuple[str, bytes, int | str] | None]:
    """A LOOKUP's ``pin`` flag, its ``lookup_id`` (required with a pin) and that id as
    scoped to ``session``."""
    pin = _flag(header, "pin")
    lookup_id = _lookup_id(header, required=pin)
    return pin, lookup_id, None if lookup_id is None else session.scoped(lookup_id)


def _frame_bytes(frame: FrameLike) -> bytes:
    if isinstance(frame, zmq.Frame):
        return frame.bytes
    return bytes(frame)


def _deadline(header: dict[str, Any], longest: float) -> float:
    """When a transaction is given up: the client says how long it waits for each request
    (``"timeout"``); past twice that it has given up too. At most ``longest`` seconds."""
    wait = header.get("timeout")
    if isinstance(wait, (int, float)) and not isinstance(wait, bool) and 0 < wait < longest:
        return time.monotonic() + min(2 * float(wait), longest)
    return time.monotonic() + longest


def _flag(header: dict[str, Any], name: str, *, required: bool = False) -> bool:
    value = header.get(name)
    if value is None and not required:
        return False
    if not isinstance(value, bool):
        raise ProtocolError(f"'{name}' must be a bool")
    return value


def _int(header: dict[str, Any], name: str, default: int) -> int:
    value = header.get(name, default)
    if not is_strict_int(value) or value < 0:
        raise ProtocolError(f"'{name}' must be an int >= 0")
    return int(value)


def _seconds(header: dict[str, Any], name: str) -> float | None:
    value = header.get(name)
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ProtocolError(f"'{name}' must be a positive number of seconds")
    return float(value)


def _checksums(header: dict[str, Any], count: int) -> list[int]:
    """The ``"checksums"`` of a push: one unsigned 64-bit int per payload frame."""
    value = header.get("checksums")
    if (
        not isinstance(value, list)
        or len(value) != count
        or not all(is_strict_int(item) and 0 <= item < 1 << 64 for item in value)
    ):
        raise ProtocolError(f"'checksums' must list one unsigned 64-bit int per payload ({count})")
    return value


def _lookup_id(header: dict[str, Any], *, required: bool) -> int | str | None:
    value = header.get("lookup_id")
    if value is None:
        if required:
            raise InvalidInputError("this request needs a lookup_id")
        return None
    if not (is_strict_int(value) or isinstance(value, str)):
        raise ProtocolError("'lookup_id' must be an int or str")
    return value  # type: ignore[no-any-return]


def _locations(header: dict[str, Any], name: str) -> list[str] | None:
    value = header.get(name)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ProtocolError(f"'{name}' must be a list of tier names")
    return value


def _digests(message: Message) -> memoryview:
    """A LOOKUP's chunk digests: one payload frame of :data:`DIGEST_SIZE`-byte digests, as
    they came (the engine takes them so)."""
    if len(message.payloads) != 1:
        raise ProtocolError("a lookup by digests carries one payload frame")
    frame = message.payloads[0]
    if frame.nbytes % DIGEST_SIZE:
        raise ProtocolError(f"the digests frame is not a multiple of {DIGEST_SIZE} bytes")
    return frame


def _key_input(
    message: Message,
) -> tuple[np.ndarray | None, list[int | bytes] | None, list[int] | None]:
    """A request's keys: one token payload frame, or ``hashes`` with ``offsets``."""
    header = message.header
    if "hashes" in header:
        offsets = header.get("offsets")
        if not isinstance(offsets, list):
            raise ProtocolError("a request by hashes needs an 'offsets' list")
        return None, hashes_from_wire(header["hashes"]), offsets
    if not message.payloads:
        raise ProtocolError("a request carries 'hashes' or a token payload frame")
    return tokens_from_payload(message.payloads[0]), None, None


# -- the process shell -------------------------------------------------------------------


def _create_segment(nbytes: int) -> shared_memory.SharedMemory:
    """A new shared-memory segment for the host arena.

    Raises:
        ConfigError: ``max_local_cpu_size`` does not fit in the shared-memory filesystem
            (writing past it would kill the process with SIGBUS), or it cannot be created.
    """
    size = -(-nbytes // 4096) * 4096
    with contextlib.suppress(OSError):
        stat = os.statvfs(_SHM_DIR)
        free = stat.f_bavail * stat.f_frsize
        if size > free:
            raise ConfigError(
                "max_local_cpu_size",
                f"{size} bytes of shared memory asked, but {_SHM_DIR} has {free} free: "
                "lower max_local_cpu_size or enlarge /dev/shm",
            )
    name = f"lmcache-async-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        return shared_memory.SharedMemory(name=name, create=True, size=size)
    except OSError as exc:
        raise ConfigError(
            "max_local_cpu_size", f"cannot create {size} bytes of shared memory: {exc}"
        ) from exc


def _bind(settings: SidecarSettings) -> tuple[zmq.asyncio.Context, zmq.asyncio.Socket]:
    context = zmq.asyncio.Context()
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, settings.limits.max_frame_bytes)
    if settings.curve_secret_key is not None:
        sock.curve_secretkey = settings.curve_secret_key
        sock.curve_server = True
    try:
        sock.bind(settings.listen)
    except zmq.ZMQError as exc:
        sock.close(linger=0)
        context.term()
        raise ConfigError("listen", f"cannot listen on {settings.listen}: {exc}") from None
    return context, sock


def _close_segment(segment: shared_memory.SharedMemory) -> None:
    with contextlib.suppress(FileNotFoundError):
        segment.unlink()
    gc.collect()  # views on the mapping held in reference cycles go first
    try:
        segment.close()
    except BufferError:
        # A payload view still refers to the mapping; it goes with the process.
        log.debug("sidecar_segment_still_mapped", name=segment.name)


async def serve(
    settings: SidecarSettings,
    *,
    on_ready: Callable[[SidecarServer], None] | None = None,
    handle_signals: bool = True,
) -> None:
    """Run a sidecar until SIGTERM or SIGINT (with ``handle_signals``) or a SHUTDOWN request.

    ``on_ready`` is called once the socket is bound (and, when ``settings.namespace`` is
    set, the engine is open). Shutdown is orderly: requests in flight get up to
    :data:`SHUTDOWN_GRACE_SECONDS`, transactions and pins are released, the engine flushes
    queued tier writes and closes, the segment is unlinked and the ipc file removed.

    Raises:
        ConfigError: the address cannot be bound, shared memory cannot be had, or the
            engine cannot open with ``settings.namespace``.
    """
    segment = _create_segment(settings.config.cpu_capacity_bytes)
    context: zmq.asyncio.Context | None = None
    sock: zmq.asyncio.Socket | None = None
    server: SidecarServer | None = None
    try:
        context, sock = _bind(settings)
        server = SidecarServer(settings, sock, segment)
        if settings.events is not None:
            server.publisher = EventPublisher(
                settings.events, allow_remote=settings.allow_remote, context=context
            )
        if settings.metrics_port is not None:
            server.metrics = await MetricsServer.bind(
                make_registry(server.collector()), port=settings.metrics_port
            )
        refused: ConfigError | None = None
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(server.host_engine, name="sidecar-engine")
            if settings.namespace is not None:
                refused = await _open_given(server, settings.namespace)
            if refused is not None:
                await server.close_engine()
                task_group.cancel_scope.cancel()
            else:
                if handle_signals:
                    task_group.start_soon(_watch_signals, server.stopping, name="sidecar-signals")
                await _run(server, task_group, on_ready)
        server.release_buffer()
        if refused is not None:
            raise refused  # after the task group, so the caller gets it as it is
    finally:
        if server is not None and server.metrics is not None:
            with anyio.CancelScope(shield=True):
                await server.metrics.aclose()
        if server is not None and server.publisher is not None:
            server.publisher.close()
        if sock is not None:
            sock.close(linger=0)
        if context is not None:
            context.term()
        if settings.listen.startswith("ipc://"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(settings.listen.removeprefix("ipc://"))
        _close_segment(segment)
        log.info("sidecar_stopped", endpoint=settings.listen)


async def _run(
    server: SidecarServer,
    task_group: TaskGroup,
    on_ready: Callable[[SidecarServer], None] | None,
) -> None:
    """Serve until :attr:`SidecarServer.stopping`, then shut down in order."""
    settings = server.settings
    task_group.start_soon(server.reap, name="sidecar-reaper")
    if server.publisher is not None:
        task_group.start_soon(server.publisher.watch_subscriptions, name="sidecar-subscriptions")
    if server.metrics is not None:
        task_group.start_soon(server.metrics.serve, name="sidecar-metrics")
    receiving = anyio.CancelScope()

    async def receive() -> None:
        with receiving:
            await server.receive()

    task_group.start_soon(receive, name="sidecar-receive")
    log.info(
        "sidecar_ready",
        endpoint=settings.listen,
        shm=server.segment_name,
        curve=settings.curve_secret_key is not None,
    )
    if on_ready is not None:
        on_ready(server)
    await server.stopping.wait()
    log.info("sidecar_stopping", **server.info())
    with anyio.CancelScope(shield=True):
        with anyio.move_on_after(SHUTDOWN_GRACE_SECONDS):
            await server.wait_idle()
        receiving.cancel()
        await server.close_engine()
    task_group.cancel_scope.cancel()


async def _open_given(server: SidecarServer, namespace: SidecarNamespace) -> ConfigError | None:
    """Open the engine for a namespace given at start; the error that prevents it, if any."""
    try:
        await server.open_engine(namespace)
    except ConfigError as exc:
        return exc
    except InvalidInputError as exc:
        return ConfigError("namespace", str(exc))
    return None


async def _watch_signals(stopping: anyio.Event) -> None:
    """Turn SIGTERM and SIGINT into ``stopping``. The handlers stay installed until the
    shutdown is over (this task is cancelled then), so a second signal cannot kill the
    process halfway through it."""
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            name = signal.Signals(signum).name
            if stopping.is_set():
                log.info("sidecar_signal_while_stopping", signal=name)
            else:
                log.info("sidecar_signal", signal=name)
                stopping.set()
