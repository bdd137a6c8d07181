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
run in worker threads, never on the event loop (:mod:`.redis_records`).

Every call runs under a deadline, and connection errors and timeouts mark the tier
unhealthy until :meth:`RedisBackend.check_health` gets an answer again
(:mod:`.redis_conn`, which also parses ``remote_url``).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from typing import Any, Final

import anyio
import anyio.to_thread
import structlog

from ..errors import ConfigError, InvalidInputError, TierError
from ..keys import ChunkKey
from ..memory import MemoryObj, MemoryPool
from ..stats import TierStats
from .base import StorageBackend, leading_run
from .counters import TierCounters
from .record import RecordSpec
from .redis_conn import DEFAULT_TIMEOUT, RedisConnection, RedisTarget, parse_remote_url
from .redis_records import (
    INLINE_BYTES,
    Commands,
    Encoded,
    RecordLoader,
    encode_into,
    overlapped,
    set_commands,
)

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

DEFAULT_KEY_PREFIX: Final = "lmca:"
"""Prefix of every key this tier writes; :meth:`RedisBackend.clear` deletes only these."""

DEFAULT_BATCH_BYTES: Final = 32 * 1024 * 1024
"""Bytes of values per pipelined round trip."""

PUT_SPLIT: Final = 4
"""A put sends its values in batches this many times smaller than ``batch_bytes``, so that
checking and copying the next batch overlaps sending this one (a put of one full batch
would otherwise do all its CPU work before its first byte leaves)."""

_SCRATCH_BUFFERS: Final = 2
"""Encoding buffers kept for reuse by cluster puts (one per concurrent put; more are made
as needed)."""

_GLOB_SPECIAL: Final = str.maketrans({c: "\\" + c for c in "*?[]\\"})


def _positive(value: object, name: str) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ConfigError(name, f"expected a positive number of seconds, got {value!r}")
    return float(value)


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
        target = parse_remote_url(url)
        timeout = _positive(timeout, "remote_timeout")
        self._ttl_ms = None if ttl is None else max(1, round(_positive(ttl, "remote_ttl") * 1000))
        if not isinstance(key_prefix, str) or not key_prefix:
            raise ConfigError("remote_key_prefix", f"expected a non-empty str, got {key_prefix!r}")
        self._prefix = key_prefix.encode()
        if isinstance(batch_bytes, bool) or not isinstance(batch_bytes, int) or batch_bytes <= 0:
            raise ConfigError("remote_batch_bytes", f"expected an int > 0, got {batch_bytes!r}")
        self._spec = spec
        self._loader = RecordLoader(pool, spec, allocation_timeout)
        self._chunk_bytes = max(1, math.prod(spec.shape_of(spec.max_tokens)) * spec.dtype.itemsize)
        self._batch_keys = max(1, batch_bytes // self._chunk_bytes)
        self._counts = TierCounters()
        self._conn = RedisConnection(target, timeout=timeout, counters=self._counts)
        self._scratch: list[bytearray] = []
        self._chunks = self._bytes = 0

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
            log.warning("redis_tier_unreachable_at_start", url=backend._conn.target.display)
        return backend

    def _key(self, key: ChunkKey) -> bytes:
        return self._prefix + key.to_str().encode()

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
        for present in await self._conn.exists([self._key(k) for k in keys]):
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
        out = await self._get(keys, prefix=False)
        self._counts.got(len(keys), sum(obj is not None for obj in out))
        return out

    async def get_prefix(self, keys: Sequence[ChunkKey]) -> list[MemoryObj]:
        """The leading run of ``keys`` stored, read with GETs alone (no EXISTS first).

        The run ends at the first value missing, corrupt, or left when memory ran out
        (that key counts as a miss, the keys after it not at all). Values after it are
        neither allocated nor decoded, and no batch after its batch is asked for, but the
        one already on its way (:func:`~.redis_records.overlapped` fetches one ahead).

        Raises:
            As :meth:`get`.
        """
        run = leading_run(await self._get(keys, prefix=True))
        self._counts.got(min(len(keys), len(run) + 1), len(run))
        return run

    async def _get(self, keys: Sequence[ChunkKey], *, prefix: bool) -> list[MemoryObj | None]:
        """Fetch and load ``keys`` batch by batch; with ``prefix``, stop at the batch with
        the first value missing or corrupt, and load nothing past that value."""
        out: list[MemoryObj | None] = [None] * len(keys)
        batches = self._batches(len(keys))

        async def fetch(n: int) -> list[bytes | None]:
            rkeys = [self._key(keys[i]) for i in batches[n]]
            return await self._conn.get_values(rkeys, len(rkeys) * self._chunk_bytes)

        async def load(n: int, values: list[bytes | None]) -> bool:
            batch = batches[n]
            if prefix and None in values:
                stop = values.index(None)
                batch, values = batch[:stop], values[:stop]
            exhausted, bad = await self._loader.load(keys, batch, values, out)
            if bad:
                await self._drop_corrupt([(keys[i], reason) for i, reason in bad])
            return exhausted or (prefix and (bool(bad) or len(batch) < len(batches[n])))

        try:
            await overlapped(len(batches), fetch, load)
        except BaseException:
            for obj in out:
                if obj is not None:
                    obj.unref()
            raise
        return out

    async def _drop_corrupt(self, entries: Sequence[tuple[ChunkKey, str]]) -> None:
        for key, reason in entries:
            log.warning("tier_entry_corrupt", tier=self.name, key=key.to_str(), reason=reason)
        self._counts.corrupt += len(entries)
        try:
            await self._conn.unlink([self._key(key) for key, _ in entries])
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
        todo = [i for i, present in enumerate(await self._conn.exists(rkeys)) if not present]
        step = -(-self._batch_keys // PUT_SPLIT)
        batches = [todo[i : i + step] for i in range(0, len(todo), step)]
        if self._conn.cluster:
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
        self._counts.puts += added
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

        async def encode(n: int) -> Commands:
            indices = batches[n]
            args = (
                [rkeys[i] for i in indices],
                [keys[i] for i in indices],
                [objs[i] for i in indices],
                spec,
                self._ttl_ms,
            )
            if sum(objs[i].nbytes for i in indices) > INLINE_BYTES:
                # Not cancellable: the objects must outlive the thread that reads them.
                return await anyio.to_thread.run_sync(set_commands, *args)
            return set_commands(*args)

        async def send(n: int, commands: Commands) -> bool:
            nonlocal added
            write = functools.partial(
                self._conn.write_packed, commands.buffers, len(commands.sizes)
            )
            replies = await self._conn.call("set", write, sum(commands.sizes))
            added += self._count_stored(commands.sizes, replies)
            return False

        try:
            await overlapped(len(batches), encode, send)
        finally:
            for obj in held:
                obj.unref()
        return added

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

        async def encode(n: int) -> Encoded:
            return await self._encode_batch(keys, objs, batches[n], spec)

        async def send(n: int, encoded: Encoded) -> bool:
            nonlocal added
            added += await self._send_batch([rkeys[i] for i in batches[n]], encoded)
            # Reused only once the server has answered: a send cut short may leave views
            # on the buffer in the transport's queue, still to be flushed.
            if len(self._scratch) < _SCRATCH_BUFFERS:
                self._scratch.append(encoded.buffer)
            return False

        await overlapped(len(batches), encode, send)
        return added

    async def _encode_batch(
        self,
        keys: Sequence[ChunkKey],
        objs: Sequence[MemoryObj],
        indices: Sequence[int],
        spec: RecordSpec,
    ) -> Encoded:
        """The records of one batch, one after the other in a scratch buffer."""
        held = [objs[i].ref() for i in indices]
        buffer = self._scratch.pop() if self._scratch else bytearray()
        try:
            if sum(obj.nbytes for obj in held) > INLINE_BYTES:
                # Not cancellable: the objects must outlive the thread that reads them.
                buffer, ends = await anyio.to_thread.run_sync(
                    encode_into, buffer, [keys[i] for i in indices], held, spec
                )
            else:
                buffer, ends = encode_into(buffer, [keys[i] for i in indices], held, spec)
        finally:
            for obj in held:
                obj.unref()
        return Encoded(buffer, ends)

    async def _send_batch(self, rkeys: Sequence[bytes], encoded: Encoded) -> int:
        """SET NX the records of one batch in one round trip; returns how many were new."""
        view = memoryview(encoded.buffer)
        values = [view[a:b] for a, b in itertools.pairwise([0, *encoded.ends])]

        def build(pipe: Any) -> None:
            for rkey, value in zip(rkeys, values, strict=True):
                pipe.set(rkey, value, nx=True, px=self._ttl_ms)

        results = await self._conn.pipelined("set", build, encoded.ends[-1])
        return self._count_stored([len(value) for value in values], results)

    async def remove(self, keys: Sequence[ChunkKey]) -> int:
        """Delete the given keys; returns how many were stored.

        Raises:
            TierUnavailableError: Redis is unreachable or did not answer in time.
            TierError: Redis reported another error.
        """
        if not keys:
            return 0
        removed = await self._conn.unlink([self._key(k) for k in keys])
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
        removed = await self._conn.unlink_matching(pattern)
        self._chunks = self._bytes = 0
        return removed

    def _forget(self, removed: int) -> None:
        if self._chunks:
            self._bytes -= self._bytes * min(removed, self._chunks) // self._chunks
        self._chunks = max(0, self._chunks - removed)

    def healthy(self) -> bool:
        """False from a call that could not reach Redis until :meth:`check_health`
        reaches it again (and after :meth:`aclose`)."""
        return self._conn.healthy

    async def check_health(self) -> bool:
        """PING the server (every primary of a cluster) within the timeout; updates
        :meth:`healthy`. Never raises for an unreachable server."""
        return await self._conn.ping()

    def stats(self) -> TierStats:
        return self._counts.stats(
            self.name,
            chunks=self._chunks,
            nbytes=self._bytes,
            evictions=0,
            healthy=self.healthy(),
        )

    async def aclose(self) -> None:
        """Close the connections (idempotent); later calls raise EngineClosedError."""
        self._scratch.clear()
        await self._conn.aclose()
