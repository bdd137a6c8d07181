"""Tenants in the Redis/Valkey tier: quotas kept in the server, usage, and erasure.

Many hosts share one server, so a tenant's usage lives there, in two keys under one hash
tag (one cluster slot): ``<prefix>{t:<tag hex>}:lru``, a sorted set of the tenant's chunks
(member: the key's text form, score: the server's time of its last write or hit), and
``<prefix>{t:<tag hex>}:size``, a hash of each member's record bytes plus the field
``~total``, their sum. Both start with the key prefix, so :meth:`RedisBackend.clear` deletes
them, but never match a tenant's chunk pattern ``<prefix><tag hex>*`` (``{`` is no hex).

Lua scripts keep them, each atomic on the index's node: after a batch of ``SET NX``,
*record* adds what was stored and, while the tenant is over its quota, pops its least
recently used members and returns them for the client to delete (on their own nodes in a
cluster); a member is popped by one script only, so two hosts never evict the same chunk.
*touch* refreshes the scores of hits; *forget* takes out what a client removed. With a TTL
the index keys expire with the newest write, and members last used more than a TTL ago
(hence expired) are dropped as *record* passes.

Only tenants with a quota are indexed, and only when a client has quotas: without them no
call is added to any operation. Erasure needs no index: it finds a tenant's chunks by key
prefix (``SCAN``, on every primary of a cluster).

Outside the quotas: Redis' own ``maxmemory`` eviction deletes chunks (or index keys) it
chooses, and a chunk written while the record call failed is never counted. With quotas,
use a ``maxmemory-policy`` of ``noeviction`` (or a ``volatile-*`` one with ``remote_ttl``).
A quota counts record bytes (header and payload as stored), not Redis' memory overhead.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final

from redis import exceptions as redis_errors
from redis.asyncio.cluster import RedisCluster

from lmcache_async.keys.chunks import ChunkKey
from lmcache_async.logging import get_logger
from lmcache_async.memory.pool import MemoryObj
from lmcache_async.tenancy.tenants import TAG_BYTES, TenantLimits, tag_hex, tag_of

from ..errors import ConfigError, InvalidInputError, TierError
from ..stats import TenantUsage
from .redis_conn import RedisConnection
from .redis_scripts import FORGET, RECORD, TOUCH

__all__ = ["MAX_ACCOUNTS", "Recorded", "TenantIndex", "glob_escape", "key_of_member"]

log = get_logger(__name__)

MAX_ACCOUNTS: Final = 4096
"""Tenants a client keeps figures for; past that the one seen first is forgotten (its
figures only: the index in Redis is not touched)."""

_GLOB_SPECIAL: Final = str.maketrans({c: "\\" + c for c in "*?[]\\"})


def glob_escape(text: str) -> str:
    """``text`` with the characters special to a ``SCAN MATCH`` glob escaped."""
    return text.translate(_GLOB_SPECIAL)


def key_of_member(member: bytes) -> ChunkKey | None:
    """The chunk key whose text form is ``member`` (an index member, or a Redis key with
    its prefix cut off); None for any other text."""
    try:
        return ChunkKey.from_str(member.decode("ascii"))
    except (UnicodeDecodeError, InvalidInputError):
        return None


@dataclass(slots=True)
class _Account:
    """What one client knows of one tenant: ``chunks`` and ``nbytes`` it added and has not
    removed; ``shared``, the tenant's (count, bytes) in the server's index as of the last
    script that answered; ``evictions``, ``refused`` (chunks not stored, each larger than
    the quota) and ``erased`` by this client."""

    chunks: int = 0
    nbytes: int = 0
    shared: tuple[int, int] | None = None
    evictions: int = 0
    refused: int = 0
    erased: int = 0

    def forget(self, removed: int) -> None:
        if self.chunks:
            self.nbytes -= self.nbytes * min(removed, self.chunks) // self.chunks
        self.chunks = max(0, self.chunks - removed)


@dataclass(frozen=True, slots=True)
class _Call:
    """One script call on the index of the tenant with ``tag``."""

    script: str
    tag: bytes
    args: list[Any]


@dataclass(frozen=True, slots=True)
class Recorded:
    """What :meth:`TenantIndex.stored` did to a batch: its ``refused`` chunks (of
    ``refused_bytes`` in all) were deleted again, each larger than its quota; the
    ``evicted`` chunks (any host's, each tenant's least recently used) were deleted to keep
    tenants within their quotas."""

    refused: tuple[ChunkKey, ...] = ()
    refused_bytes: int = 0
    evicted: tuple[ChunkKey, ...] = ()


class TenantIndex:
    """The tier's tenants: usage per tenant, quotas kept in the server's index, erasure.

    ``limits`` None (or with no quota) indexes nothing and adds no call to any operation.
    All calls go through ``conn`` (each under its deadline).
    """

    def __init__(
        self,
        conn: RedisConnection,
        prefix: bytes,
        limits: TenantLimits | None,
        ttl_ms: int | None,
    ) -> None:
        if limits is not None and not isinstance(limits, TenantLimits):
            raise ConfigError(
                "tenant_quotas.redis",
                f"expected TenantLimits or None, got {type(limits).__name__}",
            )
        self._conn = conn
        self._prefix = prefix
        self._limits = limits if limits is not None and limits.active else None
        self._ttl_ms = ttl_ms or 0
        self._accounts: dict[bytes, _Account] = {}
        client = conn.client
        self._scripts = {
            name: client.register_script(text)
            for name, text in (("record", RECORD), ("touch", TOUCH), ("forget", FORGET))
        }

    @property
    def active(self) -> bool:
        """Whether any tenant has a quota (and the index is kept)."""
        return self._limits is not None

    def quota(self, tag: bytes) -> int | None:
        """The quota in bytes of the tenant with ``tag`` in this tier (None: none)."""
        return None if self._limits is None else self._limits.limit(tag)

    def index_keys(self, tag: bytes) -> tuple[bytes, bytes]:
        """The tenant's sorted set and size hash (one hash tag: one cluster slot)."""
        base = self._prefix + b"{t:" + tag_hex(tag).encode() + b"}:"
        return base + b"lru", base + b"size"

    def is_chunk_key(self, rkey: bytes) -> bool:
        """Whether ``rkey`` (under the tier's prefix) is a chunk's, not an index key."""
        return not rkey.startswith(self._prefix + b"{t:")

    def _account(self, tag: bytes) -> _Account:
        accounts = self._accounts
        account = accounts.get(tag)
        if account is None:
            if len(accounts) >= MAX_ACCOUNTS:
                del accounts[next(iter(accounts))]
            account = accounts[tag] = _Account()
        return account

    # -- put ------------------------------------------------------------------------------

    def admit(
        self, keys: Sequence[ChunkKey], objs: Sequence[MemoryObj], todo: Sequence[int]
    ) -> list[int]:
        """The indices of ``todo`` worth sending: a chunk whose payload alone (as held in
        memory, before any codec) is larger than its tenant's quota is dropped and counted
        as refused; one whose record is, the index refuses after the write."""
        if self._limits is None:
            return list(todo)
        kept: list[int] = []
        for i in todo:
            tag = tag_of(keys[i])
            quota = self._limits.limit(tag)
            if quota is not None and objs[i].nbytes > quota:
                self._refused(tag, 1, quota)
            else:
                kept.append(i)
        return kept

    def _refused(self, tag: bytes, chunks: int, quota: int) -> None:
        self._account(tag).refused += chunks
        log.warning("redis_chunk_over_quota", tenant=tag_hex(tag), chunks=chunks, quota=quota)

    async def stored(self, entries: Sequence[tuple[ChunkKey, int]]) -> Recorded:
        """Account chunks the server stored (``(key, record bytes)`` each); with quotas,
        record them in the index (one pipelined round trip) and delete what it evicted or
        refused (one more).

        Raises:
            TierUnavailableError: Redis is unreachable or did not answer in time.
            TierError: Redis reported another error.
        """
        by_tag: dict[bytes, list[tuple[ChunkKey, int]]] = {}
        for key, size in entries:
            tag = tag_of(key)
            account = self._account(tag)
            account.chunks += 1
            account.nbytes += size
            if self._limits is not None and self._limits.limit(tag) is not None:
                by_tag.setdefault(tag, []).append((key, size))
        if not by_tag:
            return Recorded()
        calls: list[_Call] = []
        for tag, items in by_tag.items():
            args: list[Any] = [self.quota(tag), self._ttl_ms]
            for key, size in items:
                args += (key.to_str(), size)
            calls.append(_Call("record", tag, args))
        replies = await self._run("tenant_record", calls)
        doomed: list[bytes] = []
        refused: list[ChunkKey] = []
        evicted: list[ChunkKey] = []
        refused_bytes = 0
        for (tag, items), (gone, over, count, total) in zip(by_tag.items(), replies, strict=True):
            account = self._account(tag)
            account.shared = (int(count), int(total))
            account.evictions += len(gone)
            evicted += [key for key in map(key_of_member, gone) if key is not None]
            doomed += [self._prefix + member for member in gone]
            if over:
                mine = {key.to_str().encode(): (key, size) for key, size in items}
                over_bytes = sum(mine[member][1] for member in over)
                refused += [mine[member][0] for member in over]
                refused_bytes += over_bytes
                account.chunks -= len(over)
                account.nbytes -= over_bytes
                self._refused(tag, len(over), self.quota(tag) or 0)
                doomed += [self._prefix + member for member in over]
        if doomed:
            await self._conn.unlink(doomed)
        return Recorded(tuple(refused), refused_bytes, tuple(evicted))

    # -- get, remove ----------------------------------------------------------------------

    async def touch(self, keys: Sequence[ChunkKey]) -> None:
        """Refresh the last use of hits of tenants with a quota (one pipelined round trip
        for them all). A failure is logged, not raised: the hits are served anyway."""
        calls = self._per_tenant("touch", keys)
        if not calls:
            return
        try:
            replies = await self._run("tenant_touch", calls)
        except TierError as exc:
            log.warning("redis_tenant_touch_failed", keys=len(keys), error=str(exc))
            return
        self._shared(calls, replies)

    async def removed(self, keys: Sequence[ChunkKey], gone: Sequence[bool]) -> None:
        """Account ``keys`` a client deleted (``gone[i]``: the key was there) and take
        them out of the index.

        Raises:
            TierUnavailableError: Redis is unreachable or did not answer in time.
            TierError: Redis reported another error.
        """
        counts: dict[bytes, int] = {}
        for key, was in zip(keys, gone, strict=True):
            if was:
                tag = tag_of(key)
                counts[tag] = counts.get(tag, 0) + 1
        for tag, n in counts.items():
            self._account(tag).forget(n)
        calls = self._per_tenant("forget", keys)
        if calls:
            self._shared(calls, await self._run("tenant_forget", calls))

    def _per_tenant(self, script: str, keys: Sequence[ChunkKey]) -> list[_Call]:
        """One call of ``script`` per tenant with a quota among ``keys``, members as args."""
        if self._limits is None:
            return []
        members: dict[bytes, list[Any]] = {}
        for key in keys:
            tag = tag_of(key)
            if self._limits.limit(tag) is not None:
                members.setdefault(tag, []).append(key.to_str())
        return [_Call(script, tag, args) for tag, args in members.items()]

    def _shared(self, calls: Sequence[_Call], replies: Sequence[Any]) -> None:
        for call, (count, total) in zip(calls, replies, strict=True):
            self._account(call.tag).shared = (int(count), int(total))

    async def _run(self, op: str, calls: Sequence[_Call]) -> list[Any]:
        """Run scripts in one pipelined round trip under one deadline: ``EVALSHA`` each,
        and ``EVAL`` those a server did not have cached (a fresh or restarted node).

        Raises:
            TierUnavailableError: Redis is unreachable or did not answer in time.
            TierError: Redis reported another error (a script error included).
        """

        async def pipelined(batch: Sequence[_Call], *, sha: bool) -> list[Any]:
            async with self._conn.pipeline() as pipe:
                for call in batch:
                    script = self._scripts[call.script]
                    command = ("EVALSHA", script.sha) if sha else ("EVAL", script.script)
                    pipe.execute_command(*command, 2, *self.index_keys(call.tag), *call.args)
                return list(await pipe.execute(raise_on_error=False))

        async def run() -> list[Any]:
            replies = await pipelined(calls, sha=True)
            missing = [
                i
                for i, reply in enumerate(replies)
                if isinstance(reply, redis_errors.NoScriptError)
            ]
            if missing:
                again = await pipelined([calls[i] for i in missing], sha=False)
                for i, reply in zip(missing, again, strict=True):
                    replies[i] = reply
            for reply in replies:
                if isinstance(reply, Exception):
                    raise reply
            return replies

        return await self._conn.call(op, run)

    # -- erasure, clear, figures ----------------------------------------------------------

    async def erase(self, tag: bytes, deleted: Callable[[list[bytes]], None] | None = None) -> int:
        """Delete every chunk record of the tenant with ``tag`` (a ``SCAN`` of
        ``<prefix><tag hex>*`` on every primary, deleted page by page), then its index;
        returns how many records there were. ``deleted`` is told the Redis keys of each
        page deleted. Each page, not the whole scan, gets the deadline. Chunks other hosts
        write meanwhile may be left.

        Raises:
            InvalidInputError: ``tag`` is not
                :data:`~lmcache_async.tenancy.tenants.TAG_BYTES` bytes.
            TierUnavailableError: Redis is unreachable or did not answer in time.
            TierError: Redis reported another error.
        """
        if not isinstance(tag, bytes) or len(tag) != TAG_BYTES:
            raise InvalidInputError(f"a tenant tag is {TAG_BYTES} bytes, got {tag!r:.80}")
        pattern = glob_escape(self._prefix.decode()) + tag_hex(tag) + "*"
        erased = await self._conn.unlink_matching(pattern, deleted=deleted)
        await self._conn.unlink(list(self.index_keys(tag)))
        account = self._account(tag)
        account.chunks = account.nbytes = 0
        account.shared = None if account.shared is None else (0, 0)
        account.erased += erased
        log.info("redis_tenant_erased", tenant=tag_hex(tag), chunks=erased)
        return erased

    def cleared(self) -> None:
        """Forget what this client added and the usage it last saw (after a clear)."""
        for account in self._accounts.values():
            account.chunks = account.nbytes = 0
            account.shared = None if account.shared is None else (0, 0)

    @property
    def evictions(self) -> int:
        """Chunks this client evicted to keep tenants within their quotas."""
        return sum(account.evictions for account in self._accounts.values())

    @property
    def refused(self) -> int:
        """Chunks this client did not store, each larger than its tenant's quota."""
        return sum(account.refused for account in self._accounts.values())

    def usage(self) -> Mapping[str, TenantUsage]:
        """Usage by tag hex of the tenants this client has seen: for a tenant with a
        quota, the count and bytes the server's index reported to this client's last
        call on it (every host's chunks); else what this client added and has not
        removed."""
        out: dict[str, TenantUsage] = {}
        for tag, account in self._accounts.items():
            chunks, nbytes = account.shared or (account.chunks, account.nbytes)
            out[tag_hex(tag)] = TenantUsage(
                chunks=chunks,
                bytes=nbytes,
                evictions=account.evictions,
                erased=account.erased,
                quota_bytes=self.quota(tag),
            )
        return MappingProxyType(out)

    # -- at open --------------------------------------------------------------------------

    async def check_capacity(self) -> None:
        """Refuse a quota larger than the server's ``maxmemory`` (a cluster's: the sum over
        its primaries), which could never be held. A server that refuses ``CONFIG`` is
        asked with ``INFO memory``; one that answers neither is not checked. Warns of a
        ``maxmemory-policy`` that evicts any key (outside the quotas).

        Raises:
            ConfigError: (field ``tenant_quotas.redis``) a quota over ``maxmemory``.
        """
        if self._limits is None:
            return
        largest = self._limits.largest
        try:
            nodes = await self._conn.call("config", self._memory_settings)
        except TierError as exc:
            log.warning("redis_maxmemory_unknown", error=str(exc))
            return
        sizes = [size for size, _ in nodes]
        policies = sorted({policy for _, policy in nodes})
        if all(sizes) and any(policy.startswith("allkeys") for policy in policies):
            log.warning("redis_maxmemory_policy_evicts_outside_quotas", policies=policies)
        if sizes and all(sizes) and largest > sum(sizes):
            raise ConfigError(
                "tenant_quotas.redis",
                f"a quota of {largest} bytes is larger than the server's maxmemory of "
                f"{sum(sizes)} bytes",
            )

    async def _memory_settings(self) -> list[tuple[int, str]]:
        """``(maxmemory, maxmemory-policy)`` of the server, or of each cluster primary."""
        client = self._conn.client
        targets: dict[str, Any] = (
            {"target_nodes": RedisCluster.PRIMARIES} if self._conn.cluster else {}
        )
        try:
            reply = await client.config_get("maxmemory*", **targets)
            return [
                (int(node["maxmemory"]), str(node.get("maxmemory-policy", "")))
                for node in _per_node(reply, "maxmemory")
            ]
        except redis_errors.ResponseError as exc:
            log.debug("redis_config_refused", error=str(exc))
        reply = await client.info("memory", **targets)
        return [
            (int(node["maxmemory"]), str(node.get("maxmemory_policy", "")))
            for node in _per_node(reply, "maxmemory")
        ]


def _per_node(reply: Any, field: str) -> list[Mapping[str, Any]]:
    """A reply of one server, or a cluster's replies by node name, as a list of replies."""
    if isinstance(reply, Mapping) and field in reply:
        return [reply]
    if isinstance(reply, Mapping):
        return [node for node in reply.values() if isinstance(node, Mapping) and field in node]
    return []
