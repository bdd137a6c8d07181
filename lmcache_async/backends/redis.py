"""The Redis/Valkey tier: one self-describing record per chunk, shared by many hosts.

Each chunk is one string value, ``record header ‖ payload``
(:mod:`~lmcache_async.backends.record`), written by a single ``SET`` so a reader sees a
whole record or nothing. Keys are ``<key_prefix><ChunkKey.to_str()>``: the chunk key already
binds model, weights and KV layout, so engines of different models share a server safely.

Batches travel through pipelines: one round trip of ``EXISTS`` for a prefix lookup, of
``GET`` for a read, of ``SET NX`` for a write, split into sub-batches of about
``batch_bytes`` so that memory and each socket write stay bounded (a write in quarters of
that, so the checksums of the next quarter run while this one is sent). On a standalone
server a write's ``SET`` commands are written to the socket straight from the objects'
memory; in cluster mode (``redis-cluster://``) the records are copied into a buffer and the
cluster pipeline splits every batch by node. Checksums, copies and codecs of large batches
run in worker threads, never on the event loop.

Every call runs under a deadline (``timeout``, plus time for the bytes moved); redis-py's
socket timeouts bound each read, write and connect as well. Connection errors and timeouts
become :class:`~lmcache_async.errors.TierUnavailableError` and mark the tier unhealthy until
:meth:`RedisBackend.check_health` gets an answer again; redis-py reconnects by itself once
the server is back.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import math
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar
from urllib.parse import unquote, urlsplit

import anyio
import anyio.to_thread
import numpy as np
import structlog
from redis import exceptions as redis_errors
from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from ..errors import (
    AllocationTimeoutError,
    ConfigError,
    EngineClosedError,
    IntegrityError,
    InvalidInputError,
    TierError,
    TierUnavailableError,
)
from ..keys import ChunkKey
from ..memory import MemoryObj, MemoryPool
from ..stats import TierStats
from .base import StorageBackend
from .record import RecordHeader, RecordSpec

__all__ = [
    "DEFAULT_BATCH_BYTES",
    "PUT_SPLIT",
    "DEFAULT_KEY_PREFIX",
    "DEFAULT_TIMEOUT",
    "RedisBackend",
    "RedisTarget",
    "parse_remote_url",
]

log = structlog.get_logger(__name__)

DEFAULT_TIMEOUT: Final = 2.0
"""Seconds allowed for a connect, a socket read or write, and a small call."""

DEFAULT_KEY_PREFIX: Final = "lmca:"
"""Prefix of every key this tier writes; :meth:`RedisBackend.clear` deletes only these."""

DEFAULT_BATCH_BYTES: Final = 32 * 1024 * 1024
"""Bytes of values per pipelined round trip."""

STANDALONE_SCHEMES: Final = frozenset({"redis", "rediss", "unix", "valkey", "valkeys"})
CLUSTER_SCHEME: Final = "redis-cluster"

_MIN_RATE: Final = 50e6
"""Bytes/s a call is always allowed (its deadline grows by ``bytes / _MIN_RATE``)."""

PUT_SPLIT: Final = 4
"""A put sends its values in batches this many times smaller than ``batch_bytes``, so that
checking and copying the next batch overlaps sending this one (a put of one full batch
would otherwise do all its CPU work before its first byte leaves)."""

_INLINE_BYTES: Final = 256 * 1024
"""Batches with fewer payload bytes are checked and copied on the loop (a thread hop costs
more than the work)."""

_SCRATCH_BUFFERS: Final = 2
"""Encoding buffers kept for reuse by cluster puts (one per concurrent put; more are made
as needed)."""

_WRITE_PIECE: Final = 256 * 1024
"""Most bytes a standalone put hands to the socket per write. What the kernel does not
take at once is copied into the transport's buffer, so smaller pieces copy less but cost
more trips through the event loop; 256 KiB measured best on loopback (between 32 KiB and
1 MiB)."""

_PASSWORD_OPTION: Final = re.compile(r"([?&]password=)[^&]*", re.IGNORECASE)
_SCAN_COUNT: Final = 1000
_GLOB_SPECIAL: Final = str.maketrans({c: "\\" + c for c in "*?[]\\"})

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


def _positive(value: object, name: str) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ConfigError(name, f"expected a positive number of seconds, got {value!r}")
    return float(value)


@dataclass(slots=True)
class _Loaded:
    """A record fetched for a key, with the object allocated for its payload."""

    index: int
    header: RecordHeader
    payload: memoryview
    obj: MemoryObj


@dataclass(slots=True)
class _Encoded:
    """The records of one put batch: ``buffer[ends[i-1]:ends[i]]`` is record ``i``."""

    buffer: bytearray
    ends: list[int]


@dataclass(slots=True)
class _Commands:
    """The ``SET`` commands of one standalone put batch, ready for the wire: ``buffers``
    in order are the bytes to send (large payloads as views on their objects' memory);
    ``sizes[i]`` is the length of record ``i``."""

    buffers: list[bytearray | memoryview]
    sizes: list[int]


def _stream_writer(conn: Any) -> asyncio.StreamWriter | None:
    """The stream a connected redis-py asyncio connection writes to, if it has one."""
    writer = getattr(conn, "_writer", None)
    return writer if isinstance(writer, asyncio.StreamWriter) else None


async def _overlapped(
    count: int,
    first: Callable[[int], Awaitable[T]],
    second: Callable[[int, T], Awaitable[bool]],
) -> None:
    """Run ``second(n, await first(n))`` for ``n`` in ``range(count)``, in order, with
    ``first(n + 1)`` running while ``second(n)`` does (network I/O beside CPU work).

    ``second`` returning True stops the run. The first error of either stage is raised
    as is (not in an exception group) once the other stage has stopped; what ``first``
    produced and ``second`` never saw is dropped, so ``first`` must not hand over
    anything that needs releasing.
    """
    if count <= 1:
        if count:
            await second(0, await first(0))
        return
    errors: list[Exception] = []
    send, receive = anyio.create_memory_object_stream[tuple[int, T]]()

    async def produce() -> None:
        async with send:
            for n in range(count):
                try:
                    item = await first(n)
                except Exception as exc:
                    errors.append(exc)
                    return
                try:
                    await send.send((n, item))
                except anyio.BrokenResourceError:
                    return  # the consumer stopped

    async with anyio.create_task_group() as tg:
        tg.start_soon(produce)
        try:
            async with receive:
                async for n, item in receive:
                    if await second(n, item):
                        break
        except Exception as exc:
            errors.insert(0, exc)
        tg.cancel_scope.cancel()
    if errors:
        raise errors[0]


class RedisBackend(StorageBackend):
    """The Redis/Valkey tier, standalone or cluster. Build it with :meth:`open`.

    ``timeout`` (config ``remote_timeout``) bounds every connect, socket read and write and
    small call; ``ttl`` (``remote_ttl``) makes entries expire that many seconds after they
    are written (None: never). ``batch_bytes`` caps the values moved per round trip; puts
    to a cluster encode into up to two reused buffers of that size (kept until
    :meth:`aclose`).
    :meth:`stats` counts what this client saw: ``chunks`` and ``bytes`` are entries it added
    and has not removed, since the server is shared and entries may expire.

    Raises:
        ConfigError: a bad URL (``remote_url``), timeout (``remote_timeout``), TTL
            (``remote_ttl``), key prefix (``remote_key_prefix``) or batch size.
    """

    name = "redis"

    def __init__(
        self,
        url: str,
        *,
        pool: MemoryPool,
        spec: RecordSpec,
        allocation_timeout: float,
        timeout: float = DEFAULT_TIMEOUT,
        ttl: float | None = None,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        batch_bytes: int = DEFAULT_BATCH_BYTES,
    ) -> None:
        self._target = parse_remote_url(url)
        self._timeout = _positive(timeout, "remote_timeout")
        self._ttl_ms = None if ttl is None else max(1, round(_positive(ttl, "remote_ttl") * 1000))
        if not isinstance(key_prefix, str) or not key_prefix:
            raise ConfigError("remote_key_prefix", f"expected a non-empty str, got {key_prefix!r}")
        self._prefix = key_prefix.encode()
        if isinstance(batch_bytes, bool) or not isinstance(batch_bytes, int) or batch_bytes <= 0:
            raise ConfigError("remote_batch_bytes", f"expected an int > 0, got {batch_bytes!r}")
        self._pool = pool
        self._spec = spec
        self._allocation_timeout = allocation_timeout
        self._chunk_bytes = max(1, math.prod(spec.shape_of(spec.max_tokens)) * spec.dtype.itemsize)
        self._batch_keys = max(1, batch_bytes // self._chunk_bytes)
        self._client = self._make_client()
        self._scratch: list[bytearray] = []
        self._closed = False
        self._healthy = True
        self._chunks = self._bytes = 0
        self._hits = self._misses = self._puts = 0
        self._corrupt = self._errors = 0

    @classmethod
    async def open(
        cls,
        url: str,
        *,
        pool: MemoryPool,
        spec: RecordSpec,
        allocation_timeout: float,
        timeout: float = DEFAULT_TIMEOUT,
        ttl: float | None = None,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        batch_bytes: int = DEFAULT_BATCH_BYTES,
    ) -> RedisBackend:
        """Validate the settings, connect and probe the server once.

        A server that does not answer yet is not an error: the tier starts unhealthy and
        the health monitor brings it in when :meth:`check_health` succeeds.

        Raises:
            ConfigError: a bad setting (see the class).
        """
        backend = cls(
            url,
            pool=pool,
            spec=spec,
            allocation_timeout=allocation_timeout,
            timeout=timeout,
            ttl=ttl,
            key_prefix=key_prefix,
            batch_bytes=batch_bytes,
        )
        if not await backend.check_health():
            log.warning("redis_tier_unreachable_at_start", url=backend._target.display)
        return backend

    def _make_client(self) -> Any:
        # One immediate retry lets a pooled connection that died with a restarted server
        # reconnect transparently; anything more would only delay failing fast.
        retry = Retry(NoBackoff(), 1)
        common: dict[str, Any] = {
            "socket_timeout": self._timeout,
            "socket_connect_timeout": self._timeout,
            "retry": retry,
        }
        target = self._target
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

    # -- helpers --------------------------------------------------------------------------

    def _key(self, key: ChunkKey) -> bytes:
        return self._prefix + key.to_str().encode()

    def _pipeline(self) -> Any:
        if self._target.cluster:
            return self._client.pipeline()
        return self._client.pipeline(transaction=False)

    async def _call(self, op: str, fn: Callable[[], Awaitable[T]], nbytes: int = 0) -> T:
        """Run one network call under its deadline, mapping failures at the boundary.

        Raises:
            EngineClosedError: the tier was closed.
            TierUnavailableError: connection refused or lost, or a timeout.
            TierError: any other error the server or client reported.
        """
        if self._closed:
            raise EngineClosedError("redis tier is closed")
        try:
            with anyio.fail_after(self._timeout + nbytes / _MIN_RATE):
                return await fn()
        except (
            TimeoutError,
            OSError,
            redis_errors.ConnectionError,
            redis_errors.TimeoutError,
            redis_errors.ClusterError,
            redis_errors.ClusterDownError,
            redis_errors.BusyLoadingError,
            redis_errors.RedisClusterException,
        ) as exc:
            self._errors += 1
            if self._healthy:
                log.warning(
                    "redis_tier_down", op=op, url=self._target.display, error=repr(exc)[:200]
                )
            self._healthy = False
            raise TierUnavailableError(f"redis {op} failed: {exc!r}"[:500]) from exc
        except redis_errors.RedisError as exc:
            self._errors += 1
            log.warning("redis_tier_error", op=op, error=repr(exc)[:200])
            raise TierError(f"redis {op} failed: {exc!r}"[:500]) from exc

    async def _pipelined(self, op: str, build: Callable[[Any], None], nbytes: int = 0) -> list[Any]:
        async def run() -> list[Any]:
            async with self._pipeline() as pipe:
                build(pipe)
                return list(await pipe.execute())

        return await self._call(op, run, nbytes)

    async def _exists(self, rkeys: Sequence[bytes]) -> list[bool]:
        def build(pipe: Any) -> None:
            for rkey in rkeys:
                pipe.execute_command("EXISTS", rkey)

        return [bool(n) for n in await self._pipelined("exists", build)]

    async def _unlink(self, rkeys: Sequence[bytes]) -> int:
        def build(pipe: Any) -> None:
            for rkey in rkeys:
                pipe.execute_command("UNLINK", rkey)

        return sum(int(n) for n in await self._pipelined("unlink", build))

    def _batches(self, n: int) -> list[range]:
        step = self._batch_keys
        return [range(i, min(n, i + step)) for i in range(0, n, step)]

    # -- StorageBackend -------------------------------------------------------------------

    async def contains_prefix(self, keys: Sequence[ChunkKey]) -> int:
        """Number of leading ``keys`` stored (one pipelined EXISTS round trip).

        Raises:
            TierUnavailableError: Redis is unreachable or did not answer in time.
            TierError: Redis reported another error.
        """
        if not keys:
            return 0
        n = 0
        for present in await self._exists([self._key(k) for k in keys]):
            if not present:
                break
            n += 1
        return n

    async def get(self, keys: Sequence[ChunkKey]) -> list[MemoryObj | None]:
        """Fetch, verify and decode each key's record into a pool object (one reference
        each for the caller); None where missing, corrupt, or no memory came in time.

        Raises:
            TierUnavailableError: Redis is unreachable or did not answer in time.
            TierError: Redis reported another error.
            EngineClosedError: the tier or the pool is closed.
        """
        out: list[MemoryObj | None] = [None] * len(keys)
        batches = self._batches(len(keys))

        async def fetch(n: int) -> list[bytes | None]:
            rkeys = [self._key(keys[i]) for i in batches[n]]

            def build(pipe: Any) -> None:
                for rkey in rkeys:
                    pipe.get(rkey)

            return await self._pipelined("get", build, len(rkeys) * self._chunk_bytes)

        async def load(n: int, values: list[bytes | None]) -> bool:
            return await self._load(keys, batches[n], values, out)

        try:
            await _overlapped(len(batches), fetch, load)
        except BaseException:
            for obj in out:
                if obj is not None:
                    obj.unref()
            raise
        hits = sum(obj is not None for obj in out)
        self._hits += hits
        self._misses += len(keys) - hits
        return out

    async def _load(
        self,
        keys: Sequence[ChunkKey],
        batch: range,
        values: Sequence[bytes | None],
        out: list[MemoryObj | None],
    ) -> bool:
        """Check one fetched batch and decode it into ``out``; True when memory ran out."""
        loaded: list[_Loaded] = []
        bad: list[tuple[int, str]] = []
        exhausted = False
        try:
            for index, value in zip(batch, values, strict=True):
                if value is None:
                    continue
                try:
                    header, offset = RecordHeader.from_bytes(value)
                    self._spec.check_header(header, keys[index])
                except IntegrityError as exc:
                    bad.append((index, str(exc)))
                    continue
                try:
                    obj = await self._pool.allocate(
                        header.shape, self._spec.dtype, timeout=self._allocation_timeout
                    )
                except AllocationTimeoutError:
                    log.warning(
                        "redis_get_allocation_timeout",
                        loaded=len(loaded),
                        skipped=len(keys) - index,
                        timeout=self._allocation_timeout,
                    )
                    exhausted = True
                    break
                loaded.append(_Loaded(index, header, memoryview(value)[offset:], obj))
            nbytes = sum(len(item.payload) for item in loaded)
            if nbytes > _INLINE_BYTES:
                # Not cancellable: the objects must outlive the thread that writes them.
                failures = await anyio.to_thread.run_sync(self._decode, loaded)
            else:
                failures = self._decode(loaded)
        except BaseException:
            for item in loaded:
                item.obj.unref()
            raise
        for item in loaded:
            reason = failures.get(item.index)
            if reason is None:
                out[item.index] = item.obj
            else:
                item.obj.unref()
                bad.append((item.index, reason))
        if bad:
            await self._drop_corrupt([(keys[i], reason) for i, reason in bad])
        return exhausted

    def _decode(self, loaded: Sequence[_Loaded]) -> dict[int, str]:
        """Verify and decode payloads into their objects; returns failures by index."""
        failures: dict[int, str] = {}
        for item in loaded:
            try:
                self._spec.verify_payload(item.header, item.payload)
                self._spec.decode_into(item.header, item.payload, item.obj.tensor)
            except IntegrityError as exc:
                failures[item.index] = str(exc)
        return failures

    async def _drop_corrupt(self, entries: Sequence[tuple[ChunkKey, str]]) -> None:
        for key, reason in entries:
            log.warning("tier_entry_corrupt", tier=self.name, key=key.to_str(), reason=reason)
        self._corrupt += len(entries)
        try:
            await self._unlink([self._key(key) for key, _ in entries])
        except TierError as exc:
            # The read already missed; a later read finds the entry corrupt again.
            log.warning("redis_corrupt_delete_failed", chunks=len(entries), error=str(exc))

    async def put(
        self,
        keys: Sequence[ChunkKey],
        objs: Sequence[MemoryObj],
        *,
        spec: RecordSpec | None = None,
    ) -> int:
        """Write each payload not stored yet (existing keys are kept); returns how many
        were added. The caller keeps its references; this takes its own until the bytes
        are sent. ``spec`` overrides the tier's record spec for these writes (another
        codec, used by the engine's ``compress``); it must describe the same layout.

        Raises:
            InvalidInputError: ``keys`` and ``objs`` differ in length.
            TierUnavailableError: Redis is unreachable or did not answer in time.
            TierError: Redis reported another error.
        """
        if len(keys) != len(objs):
            raise InvalidInputError(f"{len(keys)} keys but {len(objs)} objects")
        if not keys:
            return 0
        rkeys = [self._key(k) for k in keys]
        # Skipping stored keys saves sending their payloads; SET NX still guards the race.
        todo = [i for i, present in enumerate(await self._exists(rkeys)) if not present]
        step = -(-self._batch_keys // PUT_SPLIT)
        batches = [todo[i : i + step] for i in range(0, len(todo), step)]
        if self._target.cluster:
            return await self._put_copied(keys, objs, rkeys, batches, spec or self._spec)
        return await self._put_direct(keys, objs, rkeys, batches, spec or self._spec)

    def _count_stored(self, sizes: Sequence[int], replies: Sequence[Any]) -> int:
        """Count the records of one batch that the server stored; returns how many."""
        added = 0
        for size, stored in zip(sizes, replies, strict=True):
            if stored:
                added += 1
                self._bytes += size
        self._chunks += added
        self._puts += added
        return added

    # -- put, standalone: SET commands written from the objects' memory -------------------

    async def _put_direct(
        self,
        keys: Sequence[ChunkKey],
        objs: Sequence[MemoryObj],
        rkeys: Sequence[bytes],
        batches: Sequence[Sequence[int]],
        spec: RecordSpec,
    ) -> int:
        """Put on a standalone server: each batch's ``SET`` commands go out with every
        large payload written from its object's memory, never copied in user space.

        The references are held for the whole put: views on the objects pass from the
        encoding stage to the sending one, and a batch encoded but never sent (the put
        failed or was cancelled) is simply dropped.
        """
        held = [objs[i].ref() for batch in batches for i in batch]
        added = 0

        async def encode(n: int) -> _Commands:
            indices = batches[n]
            args = (
                [rkeys[i] for i in indices],
                [keys[i] for i in indices],
                [objs[i] for i in indices],
                spec,
            )
            if sum(objs[i].nbytes for i in indices) > _INLINE_BYTES:
                # Not cancellable: the objects must outlive the thread that reads them.
                return await anyio.to_thread.run_sync(self._set_commands, *args)
            return self._set_commands(*args)

        async def send(n: int, commands: _Commands) -> bool:
            nonlocal added
            replies = await self._call(
                "set", functools.partial(self._write_sets, commands), sum(commands.sizes)
            )
            added += self._count_stored(commands.sizes, replies)
            return False

        try:
            await _overlapped(len(batches), encode, send)
        finally:
            for obj in held:
                obj.unref()
        return added

    def _set_commands(
        self,
        rkeys: Sequence[bytes],
        keys: Sequence[ChunkKey],
        objs: Sequence[MemoryObj],
        spec: RecordSpec,
    ) -> _Commands:
        """The RESP of ``SET <rkey> <header ‖ payload> NX [PX <ttl>]`` for each record.

        A value is sent as two buffers behind one bulk-string length, so a payload of at
        least ``_WRITE_PIECE`` bytes stays a view on its object; smaller ones are joined
        with the small parts around them, which saves a socket write each.
        """
        options = b"$2\r\nNX\r\n"
        if self._ttl_ms is not None:
            ttl = str(self._ttl_ms).encode()
            options += b"$2\r\nPX\r\n$%d\r\n%s\r\n" % (len(ttl), ttl)
        start = b"*%d\r\n$3\r\nSET\r\n" % (4 if self._ttl_ms is None else 6)
        buffers: list[bytearray | memoryview] = []
        sizes: list[int] = []
        joined = bytearray()
        for rkey, key, obj in zip(rkeys, keys, objs, strict=True):
            header, payload = spec.encode(key, obj)
            view = memoryview(payload).cast("B")
            size = len(header) + len(view)
            joined += b"%s$%d\r\n%s\r\n$%d\r\n" % (start, len(rkey), rkey, size)
            joined += header
            if len(view) < _WRITE_PIECE:
                joined += view
            else:
                buffers += (joined, view)
                joined = bytearray()
            joined += b"\r\n" + options
            sizes.append(size)
        buffers.append(joined)
        return _Commands(buffers, sizes)

    async def _write_sets(self, commands: _Commands) -> list[Any]:
        """Send one batch's ``SET`` commands on a pooled connection and read the replies.

        redis-py's own send hands a pipeline's buffers to ``writelines()``, which on
        Python 3.11 joins them into one bytes object, and the transport then copies what
        the socket does not take at once: two copies of every value, on the event loop.
        Here each piece of at most ``_WRITE_PIECE`` bytes goes to the socket only once the
        transport's buffer is empty, so the kernel takes it straight from the object's
        memory.

        A connection cut short mid-command is aborted (dropping whatever the transport
        still buffers) and disconnected before it goes back to the pool.
        """
        pool = self._client.connection_pool
        conn = await pool.get_connection()
        writer = _stream_writer(conn)
        transport = None if writer is None else writer.transport
        try:
            if writer is None or transport is None:
                # Not the connection this path knows: redis-py's own send is slower but
                # correct.
                await conn.send_packed_command(commands.buffers, check_health=False)
            else:
                limits = transport.get_write_buffer_limits()
                # With a high-water mark of 0, drain() returns once the transport's buffer
                # is empty, so the next write() hands its piece to send() directly.
                transport.set_write_buffer_limits(high=0)
                for buffer in commands.buffers:
                    view = memoryview(buffer)
                    for at in range(0, len(view), _WRITE_PIECE):
                        writer.write(view[at : at + _WRITE_PIECE])
                        await writer.drain()
                transport.set_write_buffer_limits(high=limits[1], low=limits[0])
            replies = [await conn.read_response() for _ in commands.sizes]
        except BaseException:
            if transport is not None:
                transport.abort()
            with anyio.move_on_after(self._timeout, shield=True):
                try:
                    await conn.disconnect(nowait=True)
                finally:
                    await pool.release(conn)
            raise
        with anyio.move_on_after(self._timeout, shield=True):
            await pool.release(conn)
        return replies

    # -- put, cluster: records copied into scratch buffers, sent by the cluster pipeline --

    async def _put_copied(
        self,
        keys: Sequence[ChunkKey],
        objs: Sequence[MemoryObj],
        rkeys: Sequence[bytes],
        batches: Sequence[Sequence[int]],
        spec: RecordSpec,
    ) -> int:
        """Put on a cluster: each batch's records are copied into a reused buffer and sent
        by the cluster pipeline, which splits them by node (the direct path above talks to
        one connection of one server)."""
        added = 0

        async def encode(n: int) -> _Encoded:
            return await self._encode_batch(keys, objs, batches[n], spec)

        async def send(n: int, encoded: _Encoded) -> bool:
            nonlocal added
            added += await self._send_batch([rkeys[i] for i in batches[n]], encoded)
            # Reused only once the server has answered: a send cut short may leave views
            # on the buffer in the transport's queue, still to be flushed.
            if len(self._scratch) < _SCRATCH_BUFFERS:
                self._scratch.append(encoded.buffer)
            return False

        await _overlapped(len(batches), encode, send)
        return added

    async def _encode_batch(
        self,
        keys: Sequence[ChunkKey],
        objs: Sequence[MemoryObj],
        indices: Sequence[int],
        spec: RecordSpec,
    ) -> _Encoded:
        """The records of one batch, one after the other in a scratch buffer."""
        held = [objs[i].ref() for i in indices]
        buffer = self._scratch.pop() if self._scratch else bytearray()
        try:
            if sum(obj.nbytes for obj in held) > _INLINE_BYTES:
                # Not cancellable: the objects must outlive the thread that reads them.
                buffer, ends = await anyio.to_thread.run_sync(
                    self._encode, buffer, [keys[i] for i in indices], held, spec
                )
            else:
                buffer, ends = self._encode(buffer, [keys[i] for i in indices], held, spec)
        finally:
            for obj in held:
                obj.unref()
        return _Encoded(buffer, ends)

    async def _send_batch(self, rkeys: Sequence[bytes], encoded: _Encoded) -> int:
        """SET NX the records of one batch in one round trip; returns how many were new."""
        view = memoryview(encoded.buffer)
        values = [view[a:b] for a, b in itertools.pairwise([0, *encoded.ends])]

        def build(pipe: Any) -> None:
            for rkey, value in zip(rkeys, values, strict=True):
                pipe.set(rkey, value, nx=True, px=self._ttl_ms)

        results = await self._pipelined("set", build, encoded.ends[-1])
        return self._count_stored([len(value) for value in values], results)

    def _encode(
        self,
        buffer: bytearray,
        keys: Sequence[ChunkKey],
        objs: Sequence[MemoryObj],
        spec: RecordSpec,
    ) -> tuple[bytearray, list[int]]:
        """Write each ``header ‖ payload`` record, one after the other, into ``buffer`` (a
        fresh one when it is too small); returns the buffer and where each record ends.

        This is the one copy a value costs on the way out. It lands in a buffer reused from
        batch to batch, whose pages are already mapped: a fresh ``header + payload`` per
        value costs page faults on every batch, and measured several times slower.
        """
        parts = [spec.encode(key, obj) for key, obj in zip(keys, objs, strict=True)]
        total = sum(len(header) + len(payload) for header, payload in parts)
        if len(buffer) < total:
            buffer = bytearray(max(total, len(buffer) * 2))
        # numpy copies without holding the GIL, so the event loop runs on meanwhile.
        out = np.frombuffer(buffer, dtype=np.uint8)
        ends: list[int] = []
        at = 0
        for header, payload in parts:
            for piece in (header, payload):
                np.copyto(out[at : at + len(piece)], np.frombuffer(piece, dtype=np.uint8))
                at += len(piece)
            ends.append(at)
        return buffer, ends

    async def remove(self, keys: Sequence[ChunkKey]) -> int:
        """Delete the given keys; returns how many were stored.

        Raises:
            TierUnavailableError: Redis is unreachable or did not answer in time.
            TierError: Redis reported another error.
        """
        if not keys:
            return 0
        removed = await self._unlink([self._key(k) for k in keys])
        self._forget(removed)
        return removed

    async def clear(self) -> int:
        """Delete every key under this tier's prefix (on every cluster node); returns how
        many there were.

        Raises:
            TierUnavailableError: Redis is unreachable or did not answer in time.
            TierError: Redis reported another error.
        """
        pattern = self._prefix.decode().translate(_GLOB_SPECIAL) + "*"
        found = self._client.scan_iter(match=pattern, count=_SCAN_COUNT)
        removed = 0
        page: list[bytes] = []
        try:
            while True:
                # Each step, not the whole scan, gets the deadline: a large store takes
                # many pages. Keys are deleted page by page as the scan goes.
                try:
                    page.append(await self._call("scan", found.__anext__))
                except StopAsyncIteration:
                    break
                if len(page) == _SCAN_COUNT:
                    removed += await self._unlink(page)
                    page = []
            if page:
                removed += await self._unlink(page)
        finally:
            with anyio.CancelScope(shield=True):
                await found.aclose()
        self._chunks = self._bytes = 0
        return removed

    def _forget(self, removed: int) -> None:
        if self._chunks:
            self._bytes -= self._bytes * min(removed, self._chunks) // self._chunks
        self._chunks = max(0, self._chunks - removed)

    def healthy(self) -> bool:
        """False from a call that could not reach Redis until :meth:`check_health`
        reaches it again (and after :meth:`aclose`)."""
        return self._healthy and not self._closed

    async def check_health(self) -> bool:
        """PING the server (every primary of a cluster) within the timeout; updates
        :meth:`healthy`. Never raises for an unreachable server."""
        if self._closed:
            return False

        async def ping() -> object:
            if self._target.cluster:
                return await self._client.ping(target_nodes=RedisCluster.PRIMARIES)
            return await self._client.ping()

        try:
            await self._call("ping", ping)
        except TierError:
            return False
        if not self._healthy:
            log.info("redis_tier_up", url=self._target.display)
        self._healthy = True
        return True

    def stats(self) -> TierStats:
        return TierStats(
            name=self.name,
            chunks=self._chunks,
            bytes=self._bytes,
            hits=self._hits,
            misses=self._misses,
            puts=self._puts,
            evictions=0,
            healthy=self.healthy(),
            corrupt=self._corrupt,
            errors=self._errors,
        )

    async def aclose(self) -> None:
        """Close the connections (idempotent); later calls raise EngineClosedError."""
        if self._closed:
            return
        self._closed = True
        self._scratch.clear()
        with anyio.move_on_after(self._timeout, shield=True):
            try:
                await self._client.aclose()
            except (OSError, redis_errors.RedisError) as exc:
                log.debug("redis_close_failed", error=repr(exc))
