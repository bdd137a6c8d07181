"""The key hasher of each tenant a request names.

A tenant is bound into the chunk keys through the key chain's seed and the key's leading
tag (:mod:`lmcache_async.tenancy.tenants`), so each tenant needs a hasher of its own. The engine's
namespace gives the default tenant (its ``tenant_salt``); a request that names another
gets that tenant's hasher, built once and kept among the most recently used few.
"""

from __future__ import annotations

import collections
from typing import Final

from lmcache_async.keys.chunks import ChunkHasher
from lmcache_async.tenancy.tenants import tenant_tag

__all__ = ["TENANT_HASHERS", "TenantHashers"]

TENANT_HASHERS: Final = 256
"""Hashers of named tenants kept (each with a small digest memo)."""

_TENANT_MEMO_PROMPTS: Final = 4
_TENANT_MEMO_BYTES: Final = 1 << 20
"""Each named tenant's memo holds at most this (a prompt of ~200k tokens): the hashers of
256 tenants a client names hold at most 256 MiB of memos together."""


class TenantHashers:
    """The default hasher, and one per tenant named by a request (LRU, ``capacity``).

    No name is kept beyond its hasher: figures show tenants by tag or by the operator's
    label (:mod:`lmcache_async.tenancy.labels`), never by name.
    """

    __slots__ = ("_base", "_capacity", "_hashers")

    def __init__(self, base: ChunkHasher, *, capacity: int = TENANT_HASHERS) -> None:
        self._base = base
        self._capacity = capacity
        self._hashers: collections.OrderedDict[str | None, ChunkHasher] = collections.OrderedDict()

    @property
    def default(self) -> ChunkHasher:
        """The hasher of the engine's own tenant."""
        return self._base

    def for_tenant(self, tenant: str | None) -> ChunkHasher:
        """The hasher of ``tenant``; None is the engine's own tenant.

        Raises:
            InvalidInputError: ``tenant`` is not a valid tenant name.
        """
        base = self._base
        if tenant is None or tenant == base.namespace.tenant_salt:
            return base
        hashers = self._hashers
        hasher = hashers.get(tenant)
        if hasher is not None:
            hashers.move_to_end(tenant)
            return hasher
        namespace = base.namespace.with_tenant(tenant)  # checks the name
        hasher = ChunkHasher(
            namespace,
            chunk_size=base.chunk_size,
            algorithm=base.algorithm,
            memo_size=_TENANT_MEMO_PROMPTS,
            memo_max_bytes=_TENANT_MEMO_BYTES,
        )
        hashers[tenant] = hasher
        if len(hashers) > self._capacity:
            hashers.popitem(last=False)
        return hasher

    def tag(self, tenant: str | None) -> bytes:
        """The tag of ``tenant``'s keys (None: the engine's own tenant).

        Raises:
            InvalidInputError: ``tenant`` is not a valid tenant name.
        """
        if tenant is None:
            return self._base.tag
        return tenant_tag(tenant)
