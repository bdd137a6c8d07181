"""Erasing a tenant from every tier, in order with the writes queued behind the stores.

:meth:`StorageManager.erase_tenant <lmcache_async.backends.manager.StorageManager.erase_tenant>`
runs :func:`erase_tenant` over its tiers. The order is what keeps a write queued before the
erasure from landing after it: the tenant's chunks are dropped from every queued write
first; a slow tier is erased only once a write of the tenant under way there has ended (or,
past the timeout, that write is told to remove what it put when it ends). A tier that is
down is asked all the same: it may be back, and if not its error says why the tenant may
still be there.

Around it all, the tenant's erasure epoch (:mod:`.epochs`) begins and ends: from its
beginning nothing of the tenant lands anywhere (a read promoted, a store committed, a
prefetch pinned, a write coming up), and after its end only work begun after it does.
"""

from __future__ import annotations

import anyio

from lmcache_async.logging import get_logger
from lmcache_async.tenancy.tenants import TAG_BYTES, tag_hex

from ..errors import EraseIncompleteError, InvalidInputError, TierError
from .cpu import CPUBackend
from .epochs import ErasureEpochs
from .tier_events import TierEvents
from .writers import TierWriter, TierWriters

__all__ = ["erase_slow_tier", "erase_tenant"]

log = get_logger(__name__)


async def erase_tenant(
    tag: bytes,
    cpu: CPUBackend,
    writers: TierWriters,
    events: TierEvents,
    epochs: ErasureEpochs,
    *,
    timeout: float,
) -> dict[str, int]:
    """Remove every chunk of the tenant with ``tag`` from the ``cpu`` tier, the slow tiers
    of ``writers`` (in their order) and their queued writes; returns the chunks removed per
    tier. The CPU tier's chunks go at once, pinned or not (their memory when the pins end),
    with a KV event in ``events``; each slow tier reports the keys it erased to its removal
    listener (the manager records their events).
    The tenant's erasure runs in ``epochs`` from the first step to the last, so that work
    marked before it lands nothing (nor does any while it runs).

    Raises:
        InvalidInputError: ``tag`` is not :data:`~lmcache_async.tenancy.tenants.TAG_BYTES` bytes.
        EraseIncompleteError: some tier could not be erased (down, failing, unable to, or a
            write of the tenant still under way after ``timeout`` seconds); every other
            tier was, and the error has their counts and why each of these failed.
    """
    if not isinstance(tag, bytes) or len(tag) != TAG_BYTES:
        raise InvalidInputError(f"a tenant tag is {TAG_BYTES} bytes, got {tag!r:.40}")
    epochs.begin(tag)
    try:
        return await _erase(tag, cpu, writers, events, timeout=timeout)
    finally:
        epochs.end(tag)


async def _erase(
    tag: bytes, cpu: CPUBackend, writers: TierWriters, events: TierEvents, *, timeout: float
) -> dict[str, int]:
    """:func:`erase_tenant` within the tenant's erasure epoch."""
    queued = {name: writer.forget(tag) for name, writer in writers.items()}
    erased = cpu.erase_tenant_nowait(tag)
    events.removed(erased, cpu.name)
    removed, failed = {cpu.name: len(erased)}, {}
    for name, writer in writers.items():
        count, why = await erase_slow_tier(writer, tag, timeout=timeout)
        if count is not None:
            removed[name] = count
        if why is not None:
            failed[name] = why
    log.info("tenant_erased", tag=tag_hex(tag), removed=removed, queued=queued, failed=failed)
    if failed:
        raise EraseIncompleteError(removed, failed)
    return removed


async def erase_slow_tier(
    writer: TierWriter, tag: bytes, *, timeout: float
) -> tuple[int | None, str | None]:
    """Erase the tenant with ``tag`` from ``writer``'s tier once no write of the tenant is
    under way there (waiting at most ``timeout`` seconds; a write still under way then
    removes what it put when it ends). Call after ``writer.forget(tag)``.

    Returns ``(chunks removed, None)``, or with the reason it is not known to be done:
    ``(None, why)`` when the tier failed or cannot erase, ``(chunks, why)`` when it erased
    but a write of the tenant was still under way. Never raises for the tier's failure.
    """
    why: str | None = None
    with anyio.move_on_after(timeout) as waited:
        await writer.settle(tag)
    if waited.cancelled_caught:
        writer.abandon(tag)
        why = (
            f"a write of the tenant was still under way after {timeout:g} s "
            "(it removes what it put when it ends)"
        )
    tier = writer.tier
    try:
        return await tier.erase_tenant(tag), why
    except (TierError, NotImplementedError) as exc:
        return None, str(exc) or type(exc).__name__
    except Exception as exc:
        log.exception("tier_erase_failed", tier=tier.name)
        return None, f"{type(exc).__name__}: {exc}"
