"""The ERASE reply read back, as every client of a sidecar reads it.

A sidecar answers ERASE with ``{"removed": {tier: chunks}, "failed": {tier: why}}``; a tier
in ``failed`` becomes an :class:`~lmcache_async.errors.EraseIncompleteError` here, as it is
in the engine, so a caller handles an erasure the same way in process and over the wire.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lmcache_async.errors import EraseIncompleteError, ProtocolError
from lmcache_async.keys.tokens import is_strict_int
from lmcache_async.tenancy.tenants import tag_hex, tenant_tag

__all__ = ["erase_result", "format_erase"]


def erase_result(header: Mapping[str, Any]) -> dict[str, int]:
    """The chunks removed per tier an ERASE reply reports.

    Raises:
        EraseIncompleteError: the reply names tiers that could not be erased.
        ProtocolError: the reply is not an ERASE reply.
    """
    removed = header.get("removed")
    failed = header.get("failed")
    if not isinstance(removed, dict) or not all(
        isinstance(tier, str) and is_strict_int(count) and count >= 0
        for tier, count in removed.items()
    ):
        raise ProtocolError("an ERASE reply without the chunks removed per tier")
    if not isinstance(failed, dict) or not all(
        isinstance(tier, str) and isinstance(why, str) for tier, why in failed.items()
    ):
        raise ProtocolError("an ERASE reply without the tiers that failed")
    if failed:
        raise EraseIncompleteError(removed, failed)
    return dict(removed)


def format_erase(
    tenant: str | None, removed: Mapping[str, int], failed: Mapping[str, str] | None = None
) -> str:
    """What an erasure did, one line per tier: the chunks removed, or why it failed. A
    tenant is named by its tag (the one its file names and Redis keys start with): its
    name is a secret, kept out of output that may be logged or shared.

    Raises:
        InvalidInputError: ``tenant`` is not None or a valid tenant name.
    """
    who = "the engine's own tenant" if tenant is None else f"tenant {tag_hex(tenant_tag(tenant))}"
    failed = failed or {}
    total = sum(removed.values())
    lines = [f"erased {who}: {total} chunks removed" + (", INCOMPLETE" if failed else "")]
    for tier in [*removed, *(name for name in failed if name not in removed)]:
        count = f"{removed[tier]:>8} chunks" if tier in removed else f"{'-':>8}"
        line = f"  {tier:<9} {count}"
        if tier in failed:
            line += f"  FAILED: {failed[tier]}"
        lines.append(line)
    return "\n".join(lines)
