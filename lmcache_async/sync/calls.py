"""What the synchronous facade's calls share: the sidecar client's answers to a lookup
server, the caller's CUDA stream handed to the engine's thread, and bounded awaiting."""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any

import anyio

from lmcache_async.engine.client import Promise
from lmcache_async.errors import InvalidInputError, TierUnavailableError
from lmcache_async.keys.tokens import Tokens
from lmcache_async.transfer.cuda_streams import current_stream

if TYPE_CHECKING:  # rpc sits above the engine: imported when a sidecar is used
    from lmcache_async.rpc.client import RemoteCacheEngine

__all__ = ["SidecarLookups", "awaited", "bounded", "call_name", "check_timeout", "with_stream"]


class SidecarLookups:
    """What a :class:`~lmcache_async.rpc.lookup.LookupServer` needs of an engine (lookup,
    lookup_unpin, stats), answered by a sidecar's client."""

    def __init__(self, remote: RemoteCacheEngine) -> None:
        self._remote = remote

    async def lookup(
        self,
        tokens: Tokens | None = None,
        *,
        lookup_id: Hashable | None = None,
        pin: bool = False,
        hashes: Sequence[int | bytes] | None = None,
        offsets: Sequence[int] | None = None,
        tenant: str | None = None,
    ) -> int:
        return await self._remote.lookup(
            tokens, lookup_id=lookup_id, pin=pin, hashes=hashes, offsets=offsets, tenant=tenant
        )

    async def promise(self, tokens: Tokens | None = None, **kwargs: Any) -> Promise:
        return await self._remote.promise(tokens, **kwargs)

    async def lookup_unpin(self, lookup_id: Hashable) -> None:
        await self._remote.lookup_unpin(lookup_id)

    def stats(self) -> dict[str, Any]:
        """This client's view (the sidecar's own stats need a round trip: ask it)."""
        remote = self._remote
        return {
            "sidecar": remote.url,
            "healthy": remote.is_healthy(),
            "shared_memory": remote.uses_shared_memory,
            "chunk_size": remote.chunk_size,
        }


def with_stream(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` of a store or retrieve with ``stream`` set, unless given, to the calling
    thread's current stream of the caches' device (None for CPU caches): taken here,
    because the engine runs the call on its own thread, whose current stream is another."""
    if kwargs.get("stream") is None:
        kwargs["stream"] = current_stream(kwargs.get("kv_caches"))
    return kwargs


async def awaited(call: Callable[[], Any]) -> Any:
    result = call()
    if inspect.isawaitable(result):
        result = await result
    return result


async def bounded(call: Callable[[], Any], limit: float) -> Any:
    """``call()`` awaited within ``limit`` seconds; cancelled (its cleanup awaited) then.

    Raises:
        TierUnavailableError: it did not finish in time.
    """
    with anyio.move_on_after(limit):
        return await awaited(call)
    raise TierUnavailableError(f"{call_name(call)} did not finish within {limit} s")


def call_name(fn: Callable[..., Any]) -> str:
    inner = fn.func if isinstance(fn, functools.partial) else fn
    return str(getattr(inner, "__name__", type(inner).__name__))


def check_timeout(name: str, value: object, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise InvalidInputError(f"{name} must be a positive number of seconds, got {value!r}")
