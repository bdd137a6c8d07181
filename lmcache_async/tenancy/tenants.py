"""Tenants: who a chunk belongs to, readable from the chunk's key alone.

A tenant is a name (vLLM's ``cache_salt``, ``tenant=`` on the API and the wire) or None,
the unnamed tenant. It is bound into the keys twice: the key chain's seed holds the name
(:class:`~lmcache_async.keys.chunks.Namespace`), so two tenants' identical prompts never share a
chunk; and the first :data:`TAG_BYTES` bytes of every key are the tenant's *tag*
(:func:`tenant_tag`), so a tier can tell whose a chunk is from its key — to keep usage
per tenant under a quota, and to find a tenant's chunks for erasure by a key prefix (file
names and Redis keys start with the key's hex form).

The tag depends on the name only, not on the model: erasing a tenant reaches its chunks of
every model in a shared Redis. The other ``DIGEST_SIZE - TAG_BYTES`` bytes (96 bits) come
from the chain; two names whose tags collide (about one pair in 4·10⁹) still get distinct
keys and merely share a quota's account.
"""

from __future__ import annotations

from typing import Final

import blake3

from lmcache_async.errors import InvalidInputError
from lmcache_async.tenancy.quotas import TierQuota

__all__ = [
    "MAX_TENANT_BYTES",
    "TAG_BYTES",
    "TenantLimits",
    "TenantNames",
    "check_tenant",
    "tag_hex",
    "tag_of",
    "tenant_tag",
]

TAG_BYTES: Final = 4
"""Leading bytes of every chunk key that name its tenant."""

MAX_TENANT_BYTES: Final = 256
"""Longest tenant name, in UTF-8 bytes."""

_TAG_DOMAIN: Final = b"lmcache_async/tenant/v1\x00"
_NONE_TAG_INPUT: Final = b"\x00"
_NAME_TAG_INPUT: Final = b"\x01"


def check_tenant(tenant: object, *, field: str = "tenant") -> str | None:
    """``tenant`` if it is None or a str of at most :data:`MAX_TENANT_BYTES` UTF-8 bytes
    (``""`` is a name, another tenant than None).

    Raises:
        InvalidInputError: anything else; the message names ``field``.
    """
    if tenant is None:
        return None
    if type(tenant) is not str:
        raise InvalidInputError(f"{field} must be None or a str, got {type(tenant).__name__}")
    try:
        size = len(tenant.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidInputError(f"{field} is not valid unicode: {tenant!r:.80}") from None
    if size > MAX_TENANT_BYTES:
        raise InvalidInputError(
            f"{field} must be at most {MAX_TENANT_BYTES} UTF-8 bytes, got {size}: {tenant!r:.80}"
        )
    return tenant


def tenant_tag(tenant: str | None) -> bytes:
    """The :data:`TAG_BYTES`-byte tag every key of ``tenant`` starts with.

    Raises:
        InvalidInputError: ``tenant`` is not a valid tenant (see :func:`check_tenant`).
    """
    name = check_tenant(tenant)
    data = _NONE_TAG_INPUT if name is None else _NAME_TAG_INPUT + name.encode("utf-8")
    return blake3.blake3(_TAG_DOMAIN + data).digest(length=TAG_BYTES)


def tag_of(key: bytes) -> bytes:
    """The tenant tag of a chunk key (or of a bare digest)."""
    return bytes(key[:TAG_BYTES])


def tag_hex(tag: bytes) -> str:
    """A tag's text form: 8 lowercase hex characters, the start of every key's text form
    (so a file name or Redis key of the tenant starts with it)."""
    return tag.hex()


class TenantNames:
    """The names behind the tags a process has seen, for figures by tenant.

    A tier knows tags only; the engine records each name it keys a request for, and figures
    name a tenant by its name when known, else as ``"tag:<8 hex>"``. Holds at most
    ``capacity`` names (the oldest are forgotten first, then shown by tag).
    """

    __slots__ = ("_capacity", "_names")

    def __init__(self, capacity: int = 4096) -> None:
        self._capacity = capacity
        self._names: dict[bytes, str | None] = {}

    def add(self, tenant: str | None) -> bytes:
        """Record ``tenant`` (checked) and return its tag."""
        tag = tenant_tag(tenant)
        names = self._names
        if tag not in names:
            if len(names) >= self._capacity:
                del names[next(iter(names))]
            names[tag] = tenant
        return tag

    def label(self, tag: bytes) -> str:
        """The tenant's name, ``"(none)"`` for the unnamed tenant, or ``"tag:<hex>"`` for a
        tag whose name this process has not seen."""
        if tag in self._names:
            name = self._names[tag]
            return "(none)" if name is None else name
        return f"tag:{tag_hex(tag)}"


class TenantLimits:
    """One tier's quotas by tenant tag, the form a tier can apply to a key.

    ``quota`` None (or a tier with no quota) limits nobody: :attr:`active` is False.
    """

    __slots__ = ("_by_tag", "_default")

    def __init__(self, quota: TierQuota | None) -> None:
        self._by_tag: dict[bytes, int] = {}
        self._default: int | None = None
        if quota is not None:
            self._by_tag = {tenant_tag(name): size for name, size in quota.named.items()}
            self._default = quota.default

    @property
    def active(self) -> bool:
        """Whether any tenant has a quota in this tier."""
        return bool(self._by_tag) or self._default is not None

    def limit(self, tag: bytes) -> int | None:
        """The quota in bytes of the tenant with ``tag``, or None when it has none."""
        return self._by_tag.get(tag, self._default)

    @property
    def has_default(self) -> bool:
        """Whether tenants not named have a quota (the ``"*"`` entry)."""
        return self._default is not None

    def named(self, tag: bytes) -> bool:
        """Whether the tenant with ``tag`` has a quota of its own (not the default)."""
        return tag in self._by_tag

    @property
    def largest(self) -> int:
        """The largest quota in bytes (0 when nobody has one), to check against a tier's
        capacity."""
        return max([*self._by_tag.values(), self._default or 0])
