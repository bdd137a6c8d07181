"""The connection of the Redis/Valkey tier: the server (or cluster) it talks to, and every
call it makes, under a deadline, with failures mapped to the project's errors.

``remote_url`` is parsed by :func:`parse_remote_url` into a :class:`RedisTarget`: a
standalone server (``redis://``, ``rediss://``, ``unix://``, ``valkey://``, ``valkeys://``)
or the startup nodes of a cluster (``redis-cluster://``). :class:`RedisConnection` owns the
redis-py client. Every call runs under a deadline (``timeout``, plus time for the bytes
moved); redis-py's socket timeouts bound each read, write and connect as well. Connection
errors and timeouts become :class:`~lmcache_async.errors.TierUnavailableError` and mark the
connection unhealthy until :meth:`RedisConnection.ping` gets an answer again; redis-py
reconnects by itself once the server is back. Other server errors become
:class:`~lmcache_async.errors.TierError`.

The values themselves (the bulk ``GET`` and ``SET NX`` of records), and the ``EXISTS``
before them, travel on connections of the tier's own (:mod:`.redis_wire`), opened with
redis-py's settings and under the same deadlines and error mapping
(:meth:`RedisConnection.guard`); a malformed reply there is a
:class:`~lmcache_async.errors.ProtocolError`, which marks the connection unhealthy too.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar
from urllib.parse import unquote, urlsplit

import anyio
from redis import exceptions as redis_errors
from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from lmcache_async.logging import get_logger

from ..errors import (
    ConfigError,
    EngineClosedError,
    ProtocolError,
    TierError,
    TierUnavailableError,
)
from .counters import TierCounters
from .redis_records import RecordLoads
from .redis_wire import Encode, Replied, WireClient

__all__ = [
    "CLUSTER_SCHEME",
    "DEFAULT_TIMEOUT",
    "STANDALONE_SCHEMES",
    "Deadline",
    "RedisConnection",
    "RedisTarget",
    "parse_remote_url",
]

log = get_logger(__name__)

DEFAULT_TIMEOUT: Final = 2.0
"""Seconds allowed for a connect, a socket read or write, and a small call."""

STANDALONE_SCHEMES: Final = frozenset({"redis", "rediss", "unix", "valkey", "valkeys"})
CLUSTER_SCHEME: Final = "redis-cluster"

_MIN_RATE: Final = 50e6
"""Bytes/s a call is always allowed (its deadline grows by ``bytes / _MIN_RATE``)."""

_PASSWORD_OPTION: Final = re.compile(r"([?&]password=)[^&]*", re.IGNORECASE)
_SCAN_COUNT: Final = 1000

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RedisTarget:
    """A parsed ``remote_url``: a standalone server (``url``) or cluster ``nodes``."""

    cluster: bool
    url: str = ""
    """redis-py URL of a standalone server (``valkey`` schemes rewritten to ``redis``)."""
    nodes: tuple[tuple[str, int], ...] = ()
    """``(host, port)`` startup nodes of a cluster."""
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    display: str = ""
    """The URL with any password masked, for logs."""


def _port(text: str, url: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ConfigError("remote_url", f"bad port {text!r} in {url!r}")
    return int(text)


def _mask(url: str) -> str:
    """``url`` with the password (in the user info or a ``password=`` option) masked."""
    url = _PASSWORD_OPTION.sub(r"\1***", url)
    scheme, sep, rest = url.partition("://")
    userinfo, at, hosts = rest.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    return f"{scheme}{sep}{userinfo.partition(':')[0]}:***@{hosts}"


def _parse_cluster(url: str) -> RedisTarget:
    rest = url[len(CLUSTER_SCHEME) + 3 :]
    if "?" in rest or "/" in rest.rstrip("/"):
        raise ConfigError("remote_url", f"a cluster URL takes no path or options: {_mask(url)!r}")
    userinfo, _, hosts = rest.rstrip("/").rpartition("@")
    username: str | None = None
    password: str | None = None
    if userinfo:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    nodes: list[tuple[str, int]] = []
    for item in hosts.split(","):
        if item.startswith("["):  # [ipv6]:port
            host, _, port = item[1:].partition("]:")
        else:
            host, _, port = item.rpartition(":")
        if not host:
            raise ConfigError(
                "remote_url", f"cluster nodes must be host:port, got {item!r} in {_mask(url)!r}"
            )
        nodes.append((host, _port(port, _mask(url))))
    return RedisTarget(
        cluster=True, nodes=tuple(nodes), username=username, password=password, display=_mask(url)
    )


def parse_remote_url(url: str) -> RedisTarget:
    """Parse ``remote_url``: ``redis://``, ``rediss://``, ``unix://``, ``valkey://``,
    ``valkeys://`` or ``redis-cluster://host:port[,host:port...]``.

    Raises:
        ConfigError: (field ``remote_url``) not a string, an unknown scheme, no host, a bad
            port or database number.
    """
    if not isinstance(url, str) or not url:
        raise ConfigError("remote_url", f"expected a URL string, got {url!r}")
    scheme, sep, _ = url.partition("://")
    scheme = scheme.lower()
    if not sep or (scheme not in STANDALONE_SCHEMES and scheme != CLUSTER_SCHEME):
        allowed = ", ".join(f"{s}://" for s in sorted({*STANDALONE_SCHEMES, CLUSTER_SCHEME}))
        raise ConfigError(
            "remote_url", f"unknown scheme in {_mask(url)!r}; expected one of {allowed}"
        )
    if scheme == CLUSTER_SCHEME:
        return _parse_cluster(url)
    if scheme.startswith("valkey"):
        url = "redis" + url[len("valkey") :]
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ConfigError("remote_url", f"malformed URL {_mask(url)!r}: {exc}") from exc
    if parts.scheme == "unix":
        if not parts.path:
            raise ConfigError("remote_url", f"no socket path in {_mask(url)!r}")
    else:
        if not parts.hostname:
            raise ConfigError("remote_url", f"no host in {_mask(url)!r}")
        if port == 0:
            raise ConfigError("remote_url", f"bad port 0 in {_mask(url)!r}")
        db = parts.path.strip("/")
        if db and not db.isdigit():
            raise ConfigError("remote_url", f"bad database number {db!r} in {_mask(url)!r}")
    return RedisTarget(cluster=False, url=url, display=_mask(url))


class Deadline:
    """The deadline of one call (:meth:`RedisConnection.guard`), which waits that are not
    the server's (memory from the pool) may stop while they last.

    :meth:`paused` is entered around every value a bulk read allocates for, so it is a
    plain context manager on the loop's clock (no generator, no library lookup per use).
    """

    def __init__(self, scope: anyio.CancelScope) -> None:
        self._scope = scope
        self._paused = 0
        self._saved = self._began = 0.0
        self._clock = asyncio.get_running_loop().time

    def paused(self) -> Deadline:
        """Stop the clock for the ``with`` block: the deadline moves on by the time it took
        (blocks of several tasks that overlap stop it once, from the first start to the
        last end)."""
        return self

    def __enter__(self) -> None:
        if not self._paused:
            self._saved, self._began = self._scope.deadline, self._clock()
            self._scope.deadline = math.inf
        self._paused += 1

    def __exit__(self, *exc: object) -> None:
        self._paused -= 1
        if not self._paused:
            self._scope.deadline = self._saved + (self._clock() - self._began)


class RedisConnection:
    """The client of one server or cluster, with the calls the tier makes on it.

    ``timeout`` bounds every connect, socket read and write and small call. Calls that
    fail are counted in ``counters.errors`` (the tier's counters); :attr:`healthy` is
    False from a call that could not reach the server until :meth:`ping` reaches it again
    (and after :meth:`aclose`).

    Raises:
        ConfigError: (field ``remote_url``) redis-py refused the target's settings.
    """

    def __init__(self, target: RedisTarget, *, timeout: float, counters: TierCounters) -> None:
        self.target = target
        self.timeout = timeout
        self.client: Any = self._make_client()
        self.wire = WireClient(self.client, cluster=target.cluster)
        self.closed = False
        self._counters = counters
        self._healthy = True

    def _make_client(self) -> Any:
        # One immediate retry lets a pooled connection that died with a restarted server
        # reconnect transparently; anything more would only delay failing fast.
        retry = Retry(NoBackoff(), 1)
        common: dict[str, Any] = {
            "socket_timeout": self.timeout,
            "socket_connect_timeout": self.timeout,
            "retry": retry,
        }
        target = self.target
        try:
            if target.cluster:
                return RedisCluster(
                    startup_nodes=[ClusterNode(host, port) for host, port in target.nodes],
                    username=target.username,
                    password=target.password,
                    **common,
                )
            return Redis.from_url(target.url, **common)
        except (ValueError, TypeError, redis_errors.RedisError) as exc:
            raise ConfigError("remote_url", f"{target.display!r}: {exc}") from exc

    @property
    def healthy(self) -> bool:
        return self._healthy and not self.closed

    @property
    def cluster(self) -> bool:
        return self.target.cluster

    def pipeline(self) -> Any:
        """A pipeline without a transaction (a cluster pipeline splits it by node)."""
        if self.target.cluster:
            return self.client.pipeline()
        return self.client.pipeline(transaction=False)

    async def call(self, op: str, fn: Callable[[], Awaitable[T]], nbytes: int = 0) -> T:
        """Run one network call under its deadline, mapping failures at the boundary.

        Raises:
            EngineClosedError: the tier was closed.
            TierUnavailableError: connection refused or lost, a timeout, or a reply that
                makes no sense.
            TierError: any other error the server or client reported.
        """
        with self.guard(op, nbytes):
            return await fn()

    @contextlib.contextmanager
    def guard(self, op: str, nbytes: int = 0) -> Iterator[Deadline]:
        """The deadline of one call (``timeout``, plus ``nbytes`` at the slowest rate
        allowed) and the mapping of its failures, as :meth:`call` describes."""
        if self.closed:
            raise EngineClosedError("redis tier is closed")
        try:
            with anyio.fail_after(self.timeout + nbytes / _MIN_RATE) as scope:
                yield Deadline(scope)
        except (
            TimeoutError,
            OSError,
            ProtocolError,
            redis_errors.ConnectionError,
            redis_errors.TimeoutError,
            redis_errors.ClusterError,
            redis_errors.ClusterDownError,
            redis_errors.BusyLoadingError,
            redis_errors.RedisClusterException,
        ) as exc:
            self._counters.errors += 1
            if self._healthy:
                log.warning(
                    "redis_tier_down", op=op, url=self.target.display, error=repr(exc)[:200]
                )
            self._healthy = False
            self.wire.discard_idle()
            raise TierUnavailableError(f"redis {op} failed: {exc!r}"[:500]) from exc
        except redis_errors.RedisError as exc:
            self._counters.errors += 1
            log.warning("redis_tier_error", op=op, error=repr(exc)[:200])
            raise TierError(f"redis {op} failed: {exc!r}"[:500]) from exc

    async def pipelined(self, op: str, build: Callable[[Any], None], nbytes: int = 0) -> list[Any]:
        async def run() -> list[Any]:
            async with self.pipeline() as pipe:
                build(pipe)
                return list(await pipe.execute())

        return await self.call(op, run, nbytes)

    async def exists(self, rkeys: Sequence[bytes]) -> list[bool]:
        """Whether each of ``rkeys`` is stored, in one pipelined round trip per server on
        the bulk path (a key another cluster node serves counts as absent).

        Raises:
            As :meth:`call`.
        """
        return await self.call("exists", lambda: self.wire.exists(rkeys))

    async def unlink(self, rkeys: Sequence[bytes]) -> int:
        return sum(await self.unlink_each(rkeys))

    async def unlink_each(self, rkeys: Sequence[bytes]) -> list[bool]:
        """Delete ``rkeys`` in one pipelined round trip; whether each was there."""

        def build(pipe: Any) -> None:
            for rkey in rkeys:
                pipe.execute_command("UNLINK", rkey)

        return [bool(n) for n in await self.pipelined("unlink", build)]

    async def get_records(
        self,
        rkeys: Sequence[bytes],
        indices: Sequence[int],
        sink: RecordLoads,
        nbytes: int,
    ) -> None:
        """``GET`` ``rkeys`` on the bulk path into ``sink`` (``indices``: the keys' numbers
        for it) in one pipelined round trip per server; ``nbytes`` is about what they
        hold, for the deadline. Time spent waiting for pool memory does not count against
        it.

        Raises:
            As :meth:`call`.
        """
        with self.guard("get", nbytes) as deadline, sink.receiving(deadline.paused):
            await self.wire.get(rkeys, indices, sink)

    async def set_records(
        self,
        rkeys: Sequence[bytes],
        indices: Sequence[int],
        encode: Encode,
        replied: Replied,
        *,
        nbytes: int,
        ttl_ms: int | None,
    ) -> None:
        """``SET NX`` each of ``rkeys`` to ``encode(indices[n])`` (``PX ttl_ms`` when
        given) on the bulk path, pipelined; ``replied`` hears each answer as it comes.

        Raises:
            As :meth:`call`.
        """
        with self.guard("set", nbytes):
            await self.wire.set(rkeys, indices, encode, replied, ttl_ms=ttl_ms)

    async def unlink_matching(
        self,
        pattern: str,
        counted: Callable[[bytes], bool] | None = None,
        deleted: Callable[[list[bytes]], None] | None = None,
    ) -> int:
        """Delete every key matching the glob ``pattern`` (on every node of a cluster),
        page by page as a ``SCAN`` finds them; returns how many there were (of those
        ``counted`` accepts, when given). ``deleted`` is told, after each page, the keys
        of it that were there and counted. Each step of the scan, not the whole of it,
        gets the deadline: a large store takes many pages.

        Raises:
            TierUnavailableError: the server is unreachable or did not answer in time.
            TierError: the server reported another error.
        """
        found = self.client.scan_iter(match=pattern, count=_SCAN_COUNT)
        removed = 0
        page: list[bytes] = []
        try:
            while True:
                try:
                    page.append(await self.call("scan", found.__anext__))
                except StopAsyncIteration:
                    break
                if len(page) == _SCAN_COUNT:
                    removed += await self._unlink_counted(page, counted, deleted)
                    page = []
            if page:
                removed += await self._unlink_counted(page, counted, deleted)
        finally:
            with anyio.CancelScope(shield=True):
                await found.aclose()
        return removed

    async def _unlink_counted(
        self,
        rkeys: Sequence[bytes],
        counted: Callable[[bytes], bool] | None,
        deleted: Callable[[list[bytes]], None] | None,
    ) -> int:
        gone = await self.unlink_each(rkeys)
        found = [
            rkey
            for rkey, was in zip(rkeys, gone, strict=True)
            if was and (counted is None or counted(rkey))
        ]
        if deleted is not None and found:
            deleted(found)
        return len(found)

    async def ping(self) -> bool:
        """PING the server (every primary of a cluster) within the timeout; updates
        :attr:`healthy`. Never raises for an unreachable server."""
        if self.closed:
            return False

        async def ping() -> object:
            if self.target.cluster:
                return await self.client.ping(target_nodes=RedisCluster.PRIMARIES)
            return await self.client.ping()

        try:
            await self.call("ping", ping)
        except TierError:
            return False
        if not self._healthy:
            log.info("redis_tier_up", url=self.target.display)
        self._healthy = True
        return True

    async def aclose(self) -> None:
        """Close the client's connections (idempotent); later calls raise
        EngineClosedError."""
        if self.closed:
            return
        self.closed = True
        self.wire.aclose()
        with anyio.move_on_after(self.timeout, shield=True):
            try:
                await self.client.aclose()
            except (OSError, redis_errors.RedisError) as exc:
                log.debug("redis_close_failed", error=repr(exc))
