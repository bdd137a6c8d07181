"""Moving a cached prefix from an engine's tier to a sidecar's tier, over ZeroMQ.

The engine knows no sockets: a move reads the chunks through the engine's request core
and pushes them to the target sidecar through a
:class:`~lmcache_async.rpc.client.RemoteCacheEngine`, which verifies every payload's
checksum before caching it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import anyio.to_thread
import numpy as np

from lmcache_async.keys.chunks import ChunkSpan
from lmcache_async.keys.tokens import Tokens
from lmcache_async.logging import get_logger
from lmcache_async.memory.pool import MemoryObj

from ..backends.record import object_checksum
from ..engine import CacheEngine
from ..errors import InvalidInputError, TierUnavailableError
from .client import RemoteCacheEngine, check_move_target

__all__ = ["move"]

log = get_logger(__name__)

# Payload bytes a move sends to its target in one message.
_MOVE_BATCH_BYTES = 64 << 20
# Below this many payload bytes a move's checksums are computed on the event loop.
_MOVE_INLINE_CHECKSUM_BYTES = 4 << 20


async def move(
    engine: CacheEngine,
    tokens: Tokens,
    old_position: str,
    new_position: tuple[str, str] | Sequence[str],
    copy: bool = True,
    *,
    timeout: float | None = None,
    tenant: str | None = None,
    server_public_key: bytes | None = None,
    client_certificate: str | tuple[bytes, bytes] | None = None,
) -> int:
    """Copy (or, with ``copy=False``, move) the stored chunks of a prefix of ``tokens``
    from ``engine``'s tier ``old_position`` to a sidecar's tier.

    ``old_position``: a tier of the engine (``"cpu"``, ``"disk"``, ``"redis"``).
    ``new_position``: ``(url, location)``, the target sidecar's ``ipc://`` or ``tcp://``
    URL and the name of its tier to write. The payloads travel as inline frames (the
    target may be on another host), at most 64 MiB a message, each with the xxh3-64
    checksum of its bytes; the target verifies every one before caching it and refuses
    a corrupt one and the chunks after it. The leading run of chunks the tier holds is
    sent, stopping at the first it does not hold or the target does not take; with
    ``copy=False`` the chunks the target took are then removed from ``old_position``
    (so moving onto this very instance's same tier drops them). The target flushes its
    queued disk or Redis writes before it answers each message.

    ``tenant``: whose chunks move (None: the engine's own tenant); the target keeps them
    as that tenant's. ``server_public_key`` and ``client_certificate``: the target's
    CURVE key and the certificate this side proves itself with (see
    :meth:`RemoteCacheEngine.connect <lmcache_async.RemoteCacheEngine.connect>`).

    ``timeout``: seconds each request to the target may take, the hello included
    (default ``remote_timeout``). Returns the number of prefix tokens (from token 0)
    the target took: 0 when it is unreachable (logged, within ``timeout``), when the
    engine is unhealthy, or when the tier lacks the first chunk. Runs on asyncio.

    Raises:
        InvalidInputError: bad tokens, ``old_position`` is not an enabled tier of the
            engine, ``new_position`` is not a (URL, tier) pair, or the target refused it
            (another namespace or chunk size, or no tier ``location``).
        EngineClosedError: the engine is closed.
    """
    if not isinstance(old_position, str):
        raise InvalidInputError(
            f"old_position must be a tier name, got {type(old_position).__name__}"
        )
    checked = engine.check_locations([old_position], "old_position")
    assert checked is not None
    source = checked[0]
    url, location = check_move_target(new_position)
    if not isinstance(copy, bool):
        raise InvalidInputError(f"copy must be a bool, got {type(copy).__name__}")
    wait = engine.config.remote_timeout if timeout is None else timeout
    if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not wait > 0:
        raise InvalidInputError(f"timeout must be a positive number, got {timeout!r}")
    spans, array = await engine.chunk_spans(tokens, tenant=tenant)
    if not spans or array is None or not engine.is_healthy():
        return 0
    namespace = engine.namespace
    try:
        async with RemoteCacheEngine.connect(
            url,
            engine.layout,
            model_name=namespace.model_name,
            revision=namespace.revision,
            tenant=namespace.tenant_salt,
            timeout=float(wait),
            server_public_key=server_public_key,
            client_certificate=client_certificate,
            shared_memory=False,
            name=f"move-from-{namespace.model_name}",
        ) as target:
            if target.chunk_size != engine.config.chunk_size:
                raise InvalidInputError(
                    f"the sidecar at {url} uses chunk_size {target.chunk_size}, "
                    f"this engine {engine.config.chunk_size}: their chunks do not match"
                )
            moved = await _push_prefix(
                engine,
                target,
                spans,
                array,
                source=source,
                location=location,
                copy=copy,
                tenant=tenant,
            )
    except TierUnavailableError as exc:
        log.warning("move_target_unreachable", url=url, error=str(exc))
        return 0
    log.info(
        "prefix_moved",
        source=source,
        url=url,
        location=location,
        copy=copy,
        tokens=moved,
        asked=int(array.shape[0]),
    )
    return moved


async def _push_prefix(
    engine: CacheEngine,
    target: RemoteCacheEngine,
    spans: list[ChunkSpan],
    tokens: np.ndarray,
    *,
    source: str,
    location: str,
    copy: bool,
    tenant: str | None,
) -> int:
    """Send the leading run of ``spans`` held by ``source`` to ``target``, batch by
    batch; returns the prefix tokens it took (removed from ``source`` unless ``copy``)."""
    load = engine.core.load
    layout = engine.layout
    keys = [span.key for span in spans]
    itemsize = layout.dtype.itemsize
    sizes = [math.prod(layout.payload_shape(s.num_tokens)) * itemsize for s in spans]
    done = 0
    while done < len(spans):
        end, total = done + 1, sizes[done]
        while end < len(spans) and total + sizes[end] <= _MOVE_BATCH_BYTES:
            total += sizes[end]
            end += 1
        objs = await load.reserve(keys[done:end], (source,))
        try:
            if not objs:
                break
            checksums = await _checksums(objs)
            first, last = spans[done], spans[done + len(objs) - 1]
            took = await target.push_chunks(
                tokens[: last.end],
                [obj.tensor for obj in objs],
                checksums=checksums,
                start=first.start,
                location=location,
                tenant=tenant,
            )
        finally:
            load.release(objs)
        accepted = sum(1 for s in spans[done : done + len(objs)] if s.end <= first.start + took)
        if accepted and not copy:
            await load.remove(keys[done : done + accepted], (source,))
        done += accepted
        if accepted < end - (done - accepted):
            break
    return spans[done - 1].end if done else 0


async def _checksums(objs: Sequence[MemoryObj]) -> list[int]:
    """The payload checksum of each object (kept on it), large batches off the loop."""
    if sum(obj.nbytes for obj in objs) < _MOVE_INLINE_CHECKSUM_BYTES:
        return [object_checksum(obj) for obj in objs]
    return await anyio.to_thread.run_sync(lambda: [object_checksum(obj) for obj in objs])
