"""The client's calls that move chunks between instances: PUSH (the receiving half of a
move) and MOVE (the sidecar moves a prefix to another sidecar), over :class:`~.moves.Moves`."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lmcache_async.keys.tokens import Tokens
from lmcache_async.rpc.client.moves import Moves

__all__ = ["MoveCalls"]


class MoveCalls:
    """The move methods of :class:`~.remote.RemoteCacheEngine` (over its ``_moves``)."""

    _moves: Moves

    async def push_chunks(
        self,
        tokens: Tokens,
        payloads: Sequence[torch.Tensor | bytes | bytearray | memoryview],
        *,
        checksums: Sequence[int],
        start: int = 0,
        location: str | None = None,
        tenant: str | None = None,
    ) -> int:
        """Cache chunk payloads in the sidecar as they are, each verified there against its
        checksum: the receiving half of :meth:`CacheEngine.move
        <lmcache_async.CacheEngine.move>`.

        ``tokens``: the prompt up to the end of the last chunk pushed. ``payloads``: the
        payload of each chunk from token ``start`` on (a multiple of the chunk size), as the
        layout's ``payload_shape(num_tokens)`` in its dtype (a contiguous CPU tensor, or its
        raw bytes). ``checksums``: the xxh3-64 of each payload's bytes
        (:func:`~lmcache_async.backends.record.payload_checksum`). They travel inline; the
        sidecar refuses a payload whose bytes or size do not match, and every chunk after
        it. ``location``: the sidecar's tier to write (default: its ``store_location``);
        queued disk or Redis writes are flushed before it answers. ``tenant``: whose chunks
        they are (None: this client's).

        Returns the tokens from ``start`` on whose chunks the sidecar took: a prefix of
        those pushed, 0 when the sidecar is unreachable or too slow (logged).

        Raises:
            InvalidInputError: bad input, or a tier the sidecar does not have.
            EngineClosedError: the client is closed.
        """
        return await self._moves.push_chunks(
            tokens, payloads, checksums=checksums, start=start, location=location, tenant=tenant
        )

    async def move(
        self,
        tokens: Tokens,
        old_position: str,
        new_position: tuple[str, str] | Sequence[str],
        copy: bool = True,
        *,
        timeout: float | None = None,
        tenant: str | None = None,
    ) -> int:
        """Have the sidecar move a prefix to another sidecar: as :meth:`CacheEngine.move
        <lmcache_async.CacheEngine.move>` run by the sidecar's engine.

        ``old_position``: a tier of this sidecar; ``new_position``: ``(url, location)`` of
        the target sidecar and its tier. The sidecar gives each request to the target this
        client's timeout; ``timeout`` bounds the whole wait here (default: ten times the
        client's timeout). ``tenant``: whose chunks (None: this client's). Only an admin
        certificate may move, to a target on the sidecar's ``--move-targets``. Returns
        the prefix tokens now at the target; 0 when this sidecar
        or the target is unreachable, or the wait ran out (logged; a move that ran out of
        time here may still finish there).

        Raises:
            InvalidInputError: bad tokens, ``old_position`` is not a tier of this sidecar,
                ``new_position`` is not a (URL, tier) pair, or the target refused it
                (another namespace or chunk size, no such tier).
            PermissionDeniedError: this client's certificate may not move.
            EngineClosedError: the client is closed.
        """
        return await self._moves.move(
            tokens, old_position, new_position, copy, timeout=timeout, tenant=tenant
        )
