"""A streamed load's next part read ahead.

A client streams a long load part by part (:mod:`~.transfers`) and asks for the next part
as soon as a reply says ``"more"``; until that request arrives the sidecar would not read
anything. Instead, when a part's request comes, the part after it is read from disk or
Redis at once, while the part itself is still being read (:func:`start_next`): the slow
tier has the next reads queued behind this part's, so it never waits between parts (a
round trip of Redis's costs it ~1 ms before the first byte of a value, which it spends
between one request and the next). The reading is a prefetch
(:meth:`~lmcache_async.core.LoadCore.prefetch`) pinned under an engine-side id of this
session, taking only memory free now; a load streams through at most three parts of
memory at once (the part its client copies, the one read for its next request, the one
after). The request for that part waits for the reading to be over, loads from what it
pinned, and drops the pins (:func:`take`, then
:meth:`~lmcache_async.core.LoadCore.drop_prefetch`). A part read for a request that will
not come (the load ended, or its next part starts elsewhere: the part was cut short) is
dropped when the part is served (:func:`settle`); a part nobody asks for keeps its pins
until ``pin_timeout`` or until the session ends.

Only loads without a lookup id: a lookup's promise has already read and pinned what its
load needs. At most :data:`MOST_AHEAD` parts a session are read ahead at once.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Final

from lmcache_async.core import LoadCore
from lmcache_async.keys.chunks import ChunkKey
from lmcache_async.rpc.sidecar.sessions import Session

__all__ = ["MOST_AHEAD", "settle", "start", "start_next", "take"]

MOST_AHEAD: Final = 4
"""Next parts one session may have read ahead at once (its streamed loads under way)."""


def start(
    session: Session, load: LoadCore, keys: Sequence[ChunkKey], locations: tuple[str, ...] | None
) -> ChunkKey | None:
    """Start reading ``keys`` (a next part) into host memory for ``session``, unless the
    part is being read ahead already, the session has :data:`MOST_AHEAD` parts ahead, or
    the engine cannot start it; returns the part's first key when this call started it."""
    if not keys or keys[0] in session.read_aheads or len(session.read_aheads) >= MOST_AHEAD:
        return None
    ahead = ("sidecar-ahead", session.identity, keys[0])
    if not load.prefetch(keys, locations, ahead):
        return None
    session.read_aheads[keys[0]] = ahead
    return keys[0]


def start_next(
    session: Session,
    load: LoadCore,
    keys: Sequence[ChunkKey],
    part: int,
    locations: tuple[str, ...] | None,
) -> ChunkKey | None:
    """At the start of a part of ``part`` chunks of ``keys`` (the load from the part's
    first chunk), start reading the part after it, assuming this one comes whole; returns
    its first key when this call started it (hand it to :func:`settle`)."""
    return start(session, load, keys[part : 2 * part], locations)


def settle(
    session: Session, load: LoadCore, started: ChunkKey | None, next_first: ChunkKey | None
) -> None:
    """A part is served: the part :func:`start_next` ``started`` reading is dropped unless
    it is the one the client asks for next (``next_first``: the next part's first key,
    None when the load ends here)."""
    if started is None or started == next_first:
        return
    ahead = session.read_aheads.pop(started, None)
    if ahead is not None:
        load.drop_prefetch(ahead)


async def take(session: Session, load: LoadCore, first: ChunkKey) -> Hashable | None:
    """The id under which the part starting at ``first`` was read ahead, once the reading
    is over (bounded by the load timeout); None when it was not. The caller loads with it
    and drops it (:meth:`~lmcache_async.core.LoadCore.drop_prefetch`)."""
    ahead = session.read_aheads.pop(first, None)
    if ahead is not None:
        await load.wait_prefetch(ahead)
    return ahead
