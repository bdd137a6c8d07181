"""A streamed load's next part read ahead.

A client streams a long load part by part (:mod:`~.transfers`) and asks for the next part
as soon as a reply says ``"more"``; until that request arrives the sidecar would not read
anything. When a part says ``"more"``, the next part's chunks are read from disk or Redis
at once instead: a prefetch (:meth:`~lmcache_async.core.LoadCore.prefetch`) pinned under
an engine-side id of this session, taking only memory free now. The request for that part
waits for the reading to be over, loads from what it pinned, and drops the pins
(:func:`take`, then :meth:`~lmcache_async.core.LoadCore.drop_prefetch`). A part nobody
asks for keeps its pins until ``pin_timeout`` or until the session ends.

Only loads without a lookup id: a lookup's promise has already read and pinned what its
load needs. At most :data:`MOST_AHEAD` parts a session are read ahead at once.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Final

from lmcache_async.core import LoadCore
from lmcache_async.keys.chunks import ChunkKey
from lmcache_async.rpc.sidecar.sessions import Session

__all__ = ["MOST_AHEAD", "start", "take"]

MOST_AHEAD: Final = 4
"""Next parts one session may have read ahead at once (its streamed loads under way)."""


def start(
    session: Session, load: LoadCore, keys: Sequence[ChunkKey], locations: tuple[str, ...] | None
) -> None:
    """Start reading ``keys`` (a next part) into host memory for ``session``, unless the
    part is being read ahead already, the session has :data:`MOST_AHEAD` parts ahead, or
    the engine cannot start it."""
    if not keys or keys[0] in session.read_aheads or len(session.read_aheads) >= MOST_AHEAD:
        return
    ahead = ("sidecar-ahead", session.identity, keys[0])
    if load.prefetch(keys, locations, ahead):
        session.read_aheads[keys[0]] = ahead


async def take(session: Session, load: LoadCore, first: ChunkKey) -> Hashable | None:
    """The id under which the part starting at ``first`` was read ahead, once the reading
    is over (bounded by the load timeout); None when it was not. The caller loads with it
    and drops it (:meth:`~lmcache_async.core.LoadCore.drop_prefetch`)."""
    ahead = session.read_aheads.pop(first, None)
    if ahead is not None:
        await load.wait_prefetch(ahead)
    return ahead
