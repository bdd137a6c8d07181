"""Tenants: who a chunk belongs to, readable from the chunk's key alone.

A tenant is a name (vLLM's ``cache_salt``, ``tenant=`` on the API and the wire) or None,
the unnamed tenant. It is bound into the keys twice: the key chain's seed holds the name
(:class:`~lmcache_async.keys.chunks.Namespace`), so two tenants' identical prompts never share a
chunk; and every key starts with the tenant's :data:`TAG_BYTES`-byte *tag*
(:func:`tenant_tag`), ahead of the chain's 16-byte link, so a tier can tell whose a chunk is
from its key — to keep usage per tenant under a quota, to find a tenant's chunks for
erasure by a key prefix (file names and Redis keys start with the key's hex form), and to
derive the tenant's encryption key.

The tag depends on the name only, not on the model: erasing a tenant reaches its chunks of
every model in a shared Redis. Everything a tier does for a tenant goes by its tag, so two
names with one tag would be one tenant there: one quota, one erasure, one key. The tag is
128 bits of blake3 so that finding such a pair costs about 2**64 hashes even as a birthday
search, and finding a name with a given tag 2**128.

A name is a secret (vLLM asks that a ``cache_salt`` be kept from third parties): figures
and logs show a tenant by its tag (:func:`tag_hex`) or by the label an operator gave it
(:mod:`.labels`), never by its name, and error messages do not repeat it.
"""

from __future__ import annotations

from typing import Final

import blake3

from lmcache_async.errors import InvalidInputError
from lmcache_async.tenancy.quotas import TierQuota

__all__ = [
    "MAX_TENANT_BYTES",
    "NONE_LABEL",
    "TAG_BYTES",
    "TenantLimits",
    "check_tenant",
    "tag_hex",
    "tag_of",
    "tenant_tag",
]

TAG_BYTES: Final = 16
"""Leading bytes of every chunk key that name its tenant (its tag)."""

NONE_LABEL: Final = "(none)"
"""How figures show the unnamed tenant (None)."""

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
        # The name is a secret: the message does not repeat it (it may end up in a log).
        raise InvalidInputError(f"{field} is not valid unicode") from None
    if size > MAX_TENANT_BYTES:
        raise InvalidInputError(
            f"{field} must be at most {MAX_TENANT_BYTES} UTF-8 bytes, got {size}"
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
    """A tag's text form: ``2 * TAG_BYTES`` lowercase hex characters, the start of every
    key's text form (so a file name or Redis key of the tenant starts with it), and how
    figures and logs show a tenant the operator gave no label."""
    return tag.hex()


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
