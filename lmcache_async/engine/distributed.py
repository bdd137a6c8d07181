"""MLA with tensor parallelism: the first rank keeps the cache, the other ranks get its KV.

With multi-head latent attention every tensor-parallel rank holds the same latent KV, so
one copy in the cache is enough (LMCache's ``save_only_first_rank``). The first rank of a
``torch.distributed`` process group (group rank 0) has a
:class:`~lmcache_async.engine.CacheEngine`; the other ranks pass ``None`` and never open a
tier or take host memory:

* :func:`store_first_rank` stores on the first rank; the others return 0 at once.
* :func:`lookup_first_rank` looks up on the first rank and broadcasts the answer.
* :func:`retrieve_broadcast` retrieves on the first rank into its own KV memory, then
  broadcasts the mask and the KV of the loaded tokens; each other rank scatters them into
  its own KV memory at its own slots.

The lookup and the retrieve are collectives: every rank of the group makes the same call,
in the same order. The blocking collectives, and the gathers and scatters around them, run
in one worker thread per call, never on the event loop, and each collective is bounded by
``timeout`` seconds. Tensors travel on the CPU for gloo and on the KV caches' device for
NCCL.

A retrieve sends, from group rank 0: a header (int64 ``[status, tokens, loaded,
piece_tokens, layers, latent, dtype]``); when tokens were loaded, the mask (uint8, one per
token); then the loaded tokens' ``KV_MLA`` payload ``[1, layers, n, latent]`` in pieces of
at most ``piece_tokens`` tokens. A rank whose own call does not match the header still
receives everything, so no rank is left waiting, and then raises.
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

import anyio
import anyio.to_thread
import torch
import torch.distributed as dist

from lmcache_async.errors import InvalidInputError, ProtocolError, TierUnavailableError
from lmcache_async.layouts import SUPPORTED_DTYPES, KVLayout, LayoutKind
from lmcache_async.logging import get_logger

if TYPE_CHECKING:
    from lmcache_async.engine import CacheEngine
    from lmcache_async.keys.tokens import Tokens

__all__ = [
    "DEFAULT_COLLECTIVE_TIMEOUT",
    "DEFAULT_PIECE_TOKENS",
    "lookup_first_rank",
    "retrieve_broadcast",
    "store_first_rank",
]

log = get_logger(__name__)

DEFAULT_PIECE_TOKENS = 1024
"""Tokens per broadcast payload piece: bounds the staging memory of a long retrieve."""

DEFAULT_COLLECTIVE_TIMEOUT = 60.0
"""Seconds one collective may take before the peer counts as unreachable."""

_HEADER_FIELDS = 7
_OK, _FAILED = 0, 1


def _check_mla(layout: KVLayout) -> None:
    if layout.kind is not LayoutKind.MLA:
        raise InvalidInputError(
            f"layout: first-rank-only caching needs the mla layout (every rank holds the same "
            f"KV), got {layout.kind.value}, whose ranks hold different heads"
        )


def _is_first(engine: CacheEngine | None, group: dist.ProcessGroup) -> bool:
    """Whether this process is group rank 0; checks that exactly it has the engine.

    Raises:
        InvalidInputError: not a member of ``group``, or the engine is on the wrong rank.
    """
    rank = dist.get_rank(group)
    if rank < 0:
        raise InvalidInputError("group: this process is not a member of the process group")
    if rank == 0 and engine is None:
        raise InvalidInputError("engine: group rank 0 keeps the cache and needs its engine")
    if rank != 0 and engine is not None:
        raise InvalidInputError(f"engine: only group rank 0 has an engine; this is rank {rank}")
    return rank == 0


def _check_timeout(timeout: float, piece_tokens: int = 1) -> None:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise InvalidInputError(f"timeout: expected a positive number, got {timeout!r}")
    if isinstance(piece_tokens, bool) or not isinstance(piece_tokens, int) or piece_tokens < 1:
        raise InvalidInputError(f"piece_tokens: expected a positive int, got {piece_tokens!r}")


class _Channel:
    """Broadcasts from group rank 0, each bounded by a timeout (blocking: worker thread)."""

    def __init__(self, group: dist.ProcessGroup, timeout: float, device: torch.device) -> None:
        self._group = group
        self._src = dist.get_global_rank(group, 0)
        self._timeout = datetime.timedelta(seconds=timeout)
        self.device = device

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Raises TierUnavailableError when the collective fails or times out."""
        try:
            work = dist.broadcast(tensor, src=self._src, group=self._group, async_op=True)
            if work is not None:
                work.wait(timeout=self._timeout)
        except RuntimeError as exc:
            raise TierUnavailableError(
                f"broadcast from the first tensor-parallel rank failed: {exc}"
            ) from exc


def _channel(
    group: dist.ProcessGroup, timeout: float, kv_device: torch.device | None = None
) -> _Channel:
    backend = str(dist.get_backend(group))
    device = kv_device if backend == "nccl" and kv_device is not None else torch.device("cpu")
    return _Channel(group, timeout, device)


async def store_first_rank(
    engine: CacheEngine | None,
    group: dist.ProcessGroup,
    tokens: Tokens | None = None,
    *,
    kv_caches: Sequence[torch.Tensor],
    slot_mapping: torch.Tensor,
    mask: torch.Tensor | None = None,
    req_id: str | None = None,
) -> int:
    """Store on group rank 0 only (see :meth:`CacheEngine.store`); other ranks return 0.

    Not a collective: no rank waits for another.

    Raises:
        InvalidInputError: the layout is not MLA, the engine is on the wrong rank, or the
            input is bad (rank 0).
    """
    if not _is_first(engine, group):
        return 0
    assert engine is not None  # checked by _is_first
    _check_mla(engine.layout)
    return await engine.store(
        tokens, kv_caches=kv_caches, slot_mapping=slot_mapping, mask=mask, req_id=req_id
    )


async def lookup_first_rank(
    engine: CacheEngine | None,
    group: dist.ProcessGroup,
    tokens: Tokens,
    *,
    timeout: float = DEFAULT_COLLECTIVE_TIMEOUT,
) -> int:
    """Prefix tokens cached, looked up on group rank 0 and broadcast to every rank.

    A collective: every rank of ``group`` calls it. When rank 0's lookup fails, every
    rank sees 0 and rank 0 raises the failure.

    Raises:
        InvalidInputError: the engine is on the wrong rank, or bad input (rank 0).
        TierUnavailableError: the broadcast failed or timed out.
    """
    _check_timeout(timeout)
    first = _is_first(engine, group)
    failure: Exception | None = None
    hits = 0
    if first:
        assert engine is not None
        try:
            hits = await engine.lookup(tokens)
        except Exception as exc:  # told to the other ranks as a miss, raised here
            failure = exc
    value = torch.tensor([hits], dtype=torch.int64)
    channel = _channel(group, timeout)
    await anyio.to_thread.run_sync(channel.broadcast, value)
    if failure is not None:
        raise failure
    return int(value.item())


async def retrieve_broadcast(
    engine: CacheEngine | None,
    group: dist.ProcessGroup,
    tokens: Tokens,
    *,
    layout: KVLayout,
    kv_caches: Sequence[torch.Tensor],
    slot_mapping: torch.Tensor,
    mask: torch.Tensor | None = None,
    req_id: str | None = None,
    lookup_id: Hashable | None = None,
    piece_tokens: int = DEFAULT_PIECE_TOKENS,
    timeout: float = DEFAULT_COLLECTIVE_TIMEOUT,
) -> torch.Tensor:
    """Load the cached KV on group rank 0 and hand it to every rank of ``group``.

    A collective: every rank calls it with the same ``tokens`` (other ranks use only their
    number), its own ``layout`` (MLA), ``kv_caches`` and ``slot_mapping``. Rank 0 retrieves
    as :meth:`CacheEngine.retrieve` does (``mask``, ``req_id`` and ``lookup_id`` apply
    there); then every rank writes the loaded tokens' KV at its own slots.

    Returns a bool CPU tensor of ``len(tokens)`` on every rank: True exactly where this
    rank's ``kv_caches`` were written (the loaded tokens whose slot here is not negative).

    Raises:
        InvalidInputError: the layout is not MLA, the engine is on the wrong rank, bad
            input, or this rank's call does not match rank 0's (after the broadcast).
        TierUnavailableError: a broadcast failed or timed out.
        ProtocolError: rank 0 sent a header this rank cannot read.
    """
    _check_mla(layout)
    _check_timeout(timeout, piece_tokens)
    first = _is_first(engine, group)
    kv_device = kv_caches[0].device if kv_caches else None
    channel = _channel(group, timeout, kv_device)
    if first:
        assert engine is not None
        _check_mla(engine.layout)
        loaded: torch.Tensor | None = None
        try:
            loaded = await engine.retrieve(
                tokens,
                kv_caches=kv_caches,
                slot_mapping=slot_mapping,
                mask=mask,
                req_id=req_id,
                lookup_id=lookup_id,
            )
        finally:
            # Sent whatever happened (a failure, a cancellation), so that the other ranks
            # are never left waiting for a header.
            with anyio.CancelScope(shield=True):
                send = functools.partial(
                    _send,
                    layout=layout,
                    kv_caches=kv_caches,
                    slot_mapping=slot_mapping,
                    piece=piece_tokens,
                )
                await anyio.to_thread.run_sync(send, channel, loaded)
        assert loaded is not None  # engine.retrieve returned
        return loaded
    num_tokens = len(tokens)
    problem: InvalidInputError | None = None
    slots: torch.Tensor | None = None
    try:
        num_blocks = layout.check_kv_caches(kv_caches)
        slots = layout.check_slot_mapping(slot_mapping, num_tokens, num_blocks).cpu()
    except InvalidInputError as exc:
        problem = exc  # raised once this rank has received what rank 0 sends
    written, mismatch = await anyio.to_thread.run_sync(
        _receive, channel, layout, kv_caches if problem is None else None, slots, num_tokens
    )
    if problem is not None:
        raise problem
    if mismatch is not None:
        raise mismatch
    return written


def _header(
    channel: _Channel, layout: KVLayout, *, status: int, tokens: int, loaded: int, piece: int
) -> torch.Tensor:
    values = [
        status,
        tokens,
        loaded,
        piece,
        layout.num_layers,
        layout.width,
        SUPPORTED_DTYPES.index(layout.dtype),
    ]
    return torch.tensor(values, dtype=torch.int64, device=channel.device)


def _send(
    channel: _Channel,
    loaded: torch.Tensor | None,
    *,
    layout: KVLayout,
    kv_caches: Sequence[torch.Tensor],
    slot_mapping: torch.Tensor,
    piece: int,
) -> None:
    """Rank 0's half of a retrieve (worker thread): header, mask, payload pieces."""
    if loaded is None:
        channel.broadcast(_header(channel, layout, status=_FAILED, tokens=0, loaded=0, piece=piece))
        return
    indices = torch.nonzero(loaded).view(-1)
    count = int(indices.shape[0])
    num_tokens = int(loaded.shape[0])
    channel.broadcast(
        _header(channel, layout, status=_OK, tokens=num_tokens, loaded=count, piece=piece)
    )
    if not count:
        return
    channel.broadcast(loaded.to(device=channel.device, dtype=torch.uint8))
    slots = slot_mapping.to(device="cpu", dtype=torch.int64)
    on_device = kv_caches[0].device.type == "cuda"
    for start in range(0, count, piece):
        part = indices[start : start + piece]
        payload = torch.empty(
            layout.payload_shape(int(part.shape[0])), dtype=layout.dtype, device=channel.device
        )
        layout.gather(kv_caches, slots[part], payload)
        if on_device:
            torch.cuda.current_stream(kv_caches[0].device).synchronize()
        channel.broadcast(payload)
    log.debug("tp_kv_broadcast", tokens=count, pieces=-(-count // piece))


def _receive(
    channel: _Channel,
    layout: KVLayout,
    kv_caches: Sequence[torch.Tensor] | None,
    slots: torch.Tensor | None,
    num_tokens: int,
) -> tuple[torch.Tensor, InvalidInputError | None]:
    """Another rank's half (worker thread): returns (mask of tokens written, mismatch).

    With ``kv_caches`` None (this rank's input was bad) everything is received and dropped.
    """
    header = torch.zeros(_HEADER_FIELDS, dtype=torch.int64, device=channel.device)
    channel.broadcast(header)
    status, tokens, count, piece, layers, width, dtype_index = (int(v) for v in header.tolist())
    written = torch.zeros(num_tokens, dtype=torch.bool)
    if status != _OK:
        return written, None
    if not 0 <= dtype_index < len(SUPPORTED_DTYPES) or min(tokens, count, layers, width) < 0:
        raise ProtocolError(f"unreadable retrieve header from the first rank: {header.tolist()}")
    if piece < 1:
        raise ProtocolError(f"unreadable retrieve header from the first rank: {header.tolist()}")
    dtype = SUPPORTED_DTYPES[dtype_index]
    mismatch: InvalidInputError | None = None
    if (layers, width, dtype) != (layout.num_layers, layout.width, layout.dtype):
        mismatch = InvalidInputError(
            f"layout: the first rank sends {layers} layers of {width} {dtype}, this rank has "
            f"{layout.num_layers} layers of {layout.width} {layout.dtype}"
        )
    elif tokens != num_tokens:
        mismatch = InvalidInputError(
            f"tokens: the first rank retrieved {tokens} tokens, this rank asked for {num_tokens}"
        )
    if not count:
        return written, mismatch
    sent = torch.zeros(tokens, dtype=torch.uint8, device=channel.device)
    channel.broadcast(sent)
    loaded = sent.cpu().bool()
    indices = torch.nonzero(loaded).view(-1)
    usable = mismatch is None and kv_caches is not None and slots is not None
    for start in range(0, count, piece):
        part = indices[start : start + piece]
        payload = torch.empty(
            (1, layers, int(part.shape[0]), width), dtype=dtype, device=channel.device
        )
        channel.broadcast(payload)
        if usable:
            assert kv_caches is not None and slots is not None
            layout.scatter(payload, kv_caches, slots[part])
    if not usable:
        return written, mismatch
    assert kv_caches is not None and slots is not None
    if kv_caches[0].device.type == "cuda":
        torch.cuda.current_stream(kv_caches[0].device).synchronize()
    return loaded & (slots >= 0), None
