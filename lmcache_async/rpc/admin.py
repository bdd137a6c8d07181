"""Administration of a running sidecar: the client side of ``lmcache-async ctl`` and
``lmcache-async stats``.

:class:`AdminClient` sends one request at a time (STATS, HEALTH, FREEZE, HOT_CACHE, CLEAR,
ERASE, PING) over a DEALER socket, each bounded by a timeout; it needs no session and no KV
layout. :func:`format_stats` renders a STATS reply as the table ``stats`` prints
(:func:`format_tenants` its figures by tenant, ``stats --by-tenant``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, Final

import anyio
import zmq
import zmq.asyncio

from lmcache_async.errors import (
    EngineClosedError,
    InvalidInputError,
    PermissionDeniedError,
    ProtocolError,
    TierError,
    TierUnavailableError,
)
from lmcache_async.rpc.admin_tenants import format_tenants
from lmcache_async.rpc.curve import CurveClientKeys
from lmcache_async.rpc.erase import erase_result
from lmcache_async.rpc.protocol import (
    ErrorCode,
    MessageLimits,
    MessageType,
    decode,
    encode,
    put_tenant,
)
from lmcache_async.rpc.tables import size_text as _size
from lmcache_async.rpc.tables import text_table as _table

__all__ = [
    "DEFAULT_ADMIN_TIMEOUT",
    "DEFAULT_ERASE_TIMEOUT",
    "AdminClient",
    "format_health",
    "format_stats",
    "format_tenants",
]

DEFAULT_ADMIN_TIMEOUT: Final = 5.0
"""Seconds an admin request waits for the sidecar's answer."""
DEFAULT_ERASE_TIMEOUT: Final = 60.0
"""Seconds an ERASE waits: erasing a tenant deletes each of its files and Redis keys."""

_LIMITS: Final = MessageLimits(max_header_bytes=16 << 20, max_payload_bytes=1 << 20)
_FRAMING_KEYS: Final = frozenset({"v", "id", "sizes"})
_TIER_COLUMNS: Final = (
    "TIER",
    "HEALTH",
    "CHUNKS",
    "BYTES",
    "HITS",
    "MISSES",
    "PUTS",
    "EVICTED",
    "CORRUPT",
    "ERRORS",
)
_ERRORS: Final[dict[str, type[Exception]]] = {
    ErrorCode.INVALID_INPUT: InvalidInputError,
    ErrorCode.ENGINE_CLOSED: EngineClosedError,
    ErrorCode.NO_SESSION: EngineClosedError,
    ErrorCode.PROTOCOL: ProtocolError,
    ErrorCode.UNSUPPORTED: ProtocolError,
    ErrorCode.FORBIDDEN: PermissionDeniedError,
    ErrorCode.BUSY: TierUnavailableError,
    ErrorCode.INTERNAL: TierError,
}


class AdminClient:
    """Admin requests to the sidecar at ``url``; use as a context manager or :meth:`close`.

    ``server_public_key`` (z85) is needed for a sidecar started with a CURVE secret key,
    and ``client_certificate``, the path of a ``zmq.auth`` secret certificate on its
    allow-list (an admin certificate for anything but STATS without tenants and HEALTH).

    Raises (constructor):
        InvalidInputError: a bad URL, timeout or key, or a certificate without a server key.
        ConfigError: ``field="client_certificate"``: the certificate cannot be read.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout: float = DEFAULT_ADMIN_TIMEOUT,
        server_public_key: bytes | None = None,
        client_certificate: str | None = None,
    ) -> None:
        if not isinstance(url, str) or not url.startswith(("ipc://", "tcp://")):
            raise InvalidInputError(f"url must be ipc://PATH or tcp://HOST:PORT, got {url!r:.80}")
        _check_timeout(timeout)
        if server_public_key is not None and len(server_public_key) != 40:
            raise InvalidInputError("server_public_key must be a 40-character z85 CURVE key")
        if client_certificate is not None and server_public_key is None:
            raise InvalidInputError("client_certificate needs the server's public key")
        keys = (
            None
            if server_public_key is None
            else CurveClientKeys.make(server_public_key, client_certificate)
        )
        self.url = url
        self.timeout = float(timeout)
        self._ids = itertools.count(1)
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, _LIMITS.max_frame_bytes)
        if keys is not None:
            keys.apply(self._socket)
        try:
            self._socket.connect(url)
        except zmq.ZMQError as exc:
            self.close()
            raise InvalidInputError(f"cannot connect to {url}: {exc}") from None

    async def request(
        self,
        msg_type: MessageType,
        header: Mapping[str, Any] | None = None,
        *,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """Send one request and return its reply's fields (the header without the
        version, request id and payload sizes); wait at most ``timeout`` seconds (default:
        the client's).

        Raises:
            TierUnavailableError: no answer within the timeout.
            InvalidInputError: the server refused the request's input.
            EngineClosedError: the server has no engine (no client said hello yet) or it
                is shutting down.
            ProtocolError: the server could not read the request, does not serve it, or
                answered something unreadable.
            TierError: the server failed while serving it.
        """
        request_id = next(self._ids)
        frames = encode(msg_type, header, request_id=request_id)
        limit = self.timeout if timeout is None else timeout
        try:
            with anyio.fail_after(limit):
                await self._socket.send_multipart(frames)
                while True:
                    reply = decode(
                        await self._socket.recv_multipart(),
                        max_header_bytes=_LIMITS.max_header_bytes,
                        max_payload_bytes=_LIMITS.max_payload_bytes,
                    )
                    if reply.request_id == request_id:
                        break
        except TimeoutError:
            raise TierUnavailableError(
                f"the sidecar at {self.url} did not answer {msg_type.name} within {limit:g} s"
            ) from None
        except zmq.ZMQError as exc:
            raise TierUnavailableError(f"{msg_type.name} to {self.url} failed: {exc}") from None
        if reply.type is MessageType.ERROR:
            code = reply.header.get("code")
            error = _ERRORS.get(code, ProtocolError) if isinstance(code, str) else ProtocolError
            raise error(f"the sidecar refused {msg_type.name}: {reply.header.get('message')}")
        if reply.type is not msg_type:
            raise ProtocolError(f"a {reply.type.name} reply to a {msg_type.name} request")
        return {key: value for key, value in reply.header.items() if key not in _FRAMING_KEYS}

    async def ping(self) -> None:
        """One round trip. Raises as :meth:`request`."""
        await self.request(MessageType.PING)

    async def stats(self) -> dict[str, Any]:
        """The STATS reply: ``"stats"`` (the engine's stats as plain data, None before the
        first client), ``"server"`` (sessions, segment, namespace) and, when the server
        tracks them, ``"latency"``, ``"events"`` and ``"uptime_s"``."""
        return await self.request(MessageType.STATS)

    async def health(self) -> dict[str, Any]:
        """``{"healthy": bool, "tiers": {name: bool}}`` after the server probed its tiers."""
        return await self.request(MessageType.HEALTH)

    async def freeze(self, enabled: bool) -> bool:
        """Switch freeze mode (stores write nothing); returns the new state."""
        return _flag(await self.request(MessageType.FREEZE, {"enabled": _bool(enabled)}))

    async def set_hot_cache(self, enabled: bool) -> bool:
        """Switch the CPU hot cache; returns the new state."""
        return _flag(await self.request(MessageType.HOT_CACHE, {"enabled": _bool(enabled)}))

    async def clear(self, locations: Sequence[str] | None = None) -> int:
        """Drop every chunk of the named tiers (default: all); returns chunks dropped."""
        header = {"locations": None if locations is None else list(locations)}
        chunks = (await self.request(MessageType.CLEAR, header)).get("chunks")
        if not isinstance(chunks, int) or isinstance(chunks, bool):
            raise ProtocolError("a CLEAR reply without a chunk count")
        return chunks

    async def erase(
        self, tenant: str | None = None, *, timeout: float = DEFAULT_ERASE_TIMEOUT
    ) -> dict[str, int]:
        """Remove every chunk of ``tenant`` (None: the sidecar engine's own tenant) from
        the sidecar's tiers; returns the chunks removed per tier. Waits at most ``timeout``
        seconds.

        Raises:
            InvalidInputError: ``tenant`` is not None or a valid tenant name, or
                ``timeout`` is not a positive number.
            EraseIncompleteError: some tier could not be erased (``removed``, ``failed``).
            TierUnavailableError: no answer in time: the erasure may or may not be done.
            EngineClosedError, ProtocolError, TierError: as :meth:`request`.
        """
        _check_timeout(timeout)
        header: dict[str, Any] = {}
        put_tenant(header, tenant)
        return erase_result(await self.request(MessageType.ERASE, header, timeout=timeout))

    def close(self) -> None:
        """Close the socket; idempotent."""
        if not self._socket.closed:
            self._socket.close(linger=0)
            self._context.term()

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _check_timeout(timeout: object) -> None:
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not math.isfinite(timeout)
        or timeout <= 0
    ):
        raise InvalidInputError(f"timeout must be a positive number, got {timeout!r}")


def _bool(value: object) -> bool:
    if not isinstance(value, bool):
        raise InvalidInputError(f"enabled must be a bool, got {type(value).__name__}")
    return value


def _flag(header: Mapping[str, Any]) -> bool:
    value = header.get("enabled")
    if not isinstance(value, bool):
        raise ProtocolError("a reply without the switch's state")
    return value


# -- the stats table ------------------------------------------------------------------------


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.3f}"


def _onoff(value: object) -> str:
    return "on" if value else "off"


def _num(mapping: Mapping[str, Any], key: str) -> float:
    value = mapping.get(key, 0)
    return float(value) if isinstance(value, (int, float)) else 0.0


def _rate(
    key: str, stats: Mapping[str, Any], previous: Mapping[str, Any] | None, seconds: float
) -> str:
    delta = _num(stats, key) - (_num(previous, key) if previous is not None else 0.0)
    return f"{delta / seconds:,.0f} tok/s" if seconds > 0 else "-"


def format_stats(
    reply: Mapping[str, Any],
    *,
    previous: Mapping[str, Any] | None = None,
    interval: float | None = None,
) -> str:
    """The STATS reply ``reply`` as a table: server, engine switches, pool usage, traffic,
    hit rate, throughput, tiers, latency percentiles and KV events.

    Throughput is averaged over the server's uptime, or with ``previous`` (an earlier
    reply) and ``interval`` (seconds between the two) over that interval.
    """
    lines: list[str] = []
    server = reply.get("server") or {}
    uptime = _num(reply, "uptime_s")
    namespace = server.get("namespace") or {}
    lines.append(
        f"sidecar     {server.get('endpoint', '?')}  pid {server.get('pid', '?')}  "
        f"up {uptime:.1f} s  sessions {server.get('sessions', 0)}  "
        f"model {namespace.get('model_name') or '-'}"
    )
    stats = reply.get("stats")
    if not stats:
        lines.append("engine      not open (no client has said hello yet)")
        lines.extend(_latency_lines(reply))
        lines.extend(_event_lines(reply, None))
        return "\n".join(lines)
    lines.append(
        f"engine      {'healthy' if stats.get('healthy') else 'UNHEALTHY'}  "
        f"frozen {_onoff(stats.get('frozen'))}  hot cache {_onoff(stats.get('hot_cache'))}"
    )
    pool = stats.get("pool") or {}
    capacity = _num(pool, "capacity_bytes")
    used = _num(pool, "used_bytes")
    share = 100 * used / capacity if capacity else 0.0
    lines.append(
        f"pool        {_size(used)} / {_size(capacity)} used ({share:.1f}%)  "
        f"objects {pool.get('num_objects', 0)}  pinned {pool.get('pinned_objects', 0)}  "
        f"waiters {pool.get('waiters', 0)}"
    )
    lines.append(
        f"requests    store {stats.get('store_requests', 0)}  "
        f"retrieve {stats.get('retrieve_requests', 0)}  lookup {stats.get('lookup_requests', 0)}"
        f"  failed {stats.get('failed_requests', 0)}  timed out "
        f"{stats.get('timed_out_requests', 0)}  partial stores {stats.get('partial_stores', 0)}"
    )
    asked = _num(stats, "lookup_tokens")
    hits = _num(stats, "lookup_hit_tokens")
    hit_rate = 100 * hits / asked if asked else 0.0
    lines.append(
        f"tokens      stored {stats.get('stored_tokens', 0)}  "
        f"retrieved {stats.get('retrieved_tokens', 0)}  "
        f"lookup hits {int(hits)} / {int(asked)}  hit rate {hit_rate:.1f}%"
    )
    if previous is not None and previous.get("stats") and interval:
        before: Mapping[str, Any] | None = previous["stats"]
        seconds, over = interval, f"over the last {interval:g} s"
    else:
        before, seconds, over = None, uptime, "since start"
    lines.append(
        f"throughput  stored {_rate('stored_tokens', stats, before, seconds)}  "
        f"retrieved {_rate('retrieved_tokens', stats, before, seconds)}  "
        f"looked up {_rate('lookup_tokens', stats, before, seconds)}  ({over})"
    )
    lines.append(
        f"chunks      cached {stats.get('cached_chunks', 0)}  "
        f"pinned {stats.get('pinned_chunks', 0)}  evicted {stats.get('evicted_chunks', 0)}  "
        f"promoted {stats.get('promoted_chunks', 0)}  "
        f"slow-tier writes pending {stats.get('tier_writes_pending', 0)}, dropped "
        f"{stats.get('tier_writes_dropped', 0)}, failed {stats.get('tier_writes_failed', 0)}"
    )
    lines.append("tiers")
    health = stats.get("tier_health") or {}
    rows = [
        [
            name,
            "up" if health.get(name, tier.get("healthy")) else "DOWN",
            tier.get("chunks", 0),
            _size(_num(tier, "bytes")),
            tier.get("hits", 0),
            tier.get("misses", 0),
            tier.get("puts", 0),
            tier.get("evictions", 0),
            tier.get("corrupt", 0),
            tier.get("errors", 0),
        ]
        for name, tier in (stats.get("tiers") or {}).items()
    ]
    lines.append(_table(_TIER_COLUMNS, rows))
    lines.extend(_latency_lines(reply))
    lines.extend(_event_lines(reply, stats))
    return "\n".join(lines)


def _latency_lines(reply: Mapping[str, Any]) -> list[str]:
    latency = reply.get("latency")
    if not latency:
        return ["latency     not tracked by this server"]
    rows = [
        [
            op,
            entry.get("count", 0),
            _ms(_num(entry, "p50")),
            _ms(_num(entry, "p90")),
            _ms(_num(entry, "p99")),
            _ms(_num(entry, "max")),
        ]
        for op, entry in latency.items()
        if entry.get("count")
    ]
    if not rows:
        return ["latency     no requests yet"]
    window = max(_num(entry, "window") for entry in latency.values())
    return [
        f"latency (ms, latest {int(window)} requests per operation)",
        _table(["OP", "COUNT", "P50", "P90", "P99", "MAX"], rows),
    ]


def _event_lines(reply: Mapping[str, Any], stats: Mapping[str, Any] | None) -> list[str]:
    events = reply.get("events")
    dropped = 0 if stats is None else stats.get("events_dropped", 0)
    if not events:
        return [f"kv events   not published (buffer drops {dropped})"]
    return [
        f"kv events   {events.get('endpoint')}  published {events.get('published', 0)}  "
        f"subscribers {events.get('subscribers', 0)}  buffer drops {dropped}"
    ]


def format_health(reply: Mapping[str, Any]) -> str:
    """A HEALTH reply as text: overall state, then one line per tier."""
    lines = [f"healthy     {'yes' if reply.get('healthy') else 'NO'}"]
    if reply.get("engine") is False:
        lines.append("engine      not open (no client has said hello yet)")
    for name, up in sorted((reply.get("tiers") or {}).items()):
        lines.append(f"  {name:<9} {'up' if up else 'DOWN'}")
    return "\n".join(lines)
