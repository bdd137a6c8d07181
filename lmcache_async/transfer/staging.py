"""The device staging buffer of staged transfers (:mod:`lmcache_async.transfer.staged`).

A staged gather writes a whole batch of chunk payloads into one buffer on the caches'
device, then moves it to host memory in a few large copies; a staged scatter does the
reverse. :class:`StagingBuffer` is that buffer, kept from one batch to the next: it grows
to the largest batch it has carried (up to a bound; larger batches go through in several
passes) and is freed by :meth:`StagingBuffer.close`.

One buffer serves one copy stream at a time. Its owner keeps two per device and direction
(the engine's :class:`~lmcache_async.transfer.cuda.Transfers` has a store and a load stream per
device, each with a second stream: :class:`~lmcache_async.transfer.pipelined.Lanes`), so that a
store and a load never wait on each other for one; a batch that also uses a buffer on the
second stream makes the first wait for that work before its use ends. Callers that
share one anyway are safe: :meth:`StagingBuffer.use` holds a lock while a batch is queued,
and a use on another CUDA stream than the last one first waits for the last one's work
(an event) and tells the caching allocator about the new stream (``record_stream``), so
the memory is never handed out again under a copy still queued.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, Final, NamedTuple

import torch

from lmcache_async.errors import EngineClosedError, InvalidInputError

__all__ = ["DEFAULT_STAGING_BYTES", "StagingBuffer", "StagingStats"]

DEFAULT_STAGING_BYTES: Final = 256 * 1024**2
"""Bound on a staging buffer's size: a batch of more bytes moves in several passes."""

_GRANULE_ALIGNMENT: Final = 256
"""A host granule must be a multiple of this (a memory pool's page size is)."""

_ROUNDING: Final = 1024**2
"""Buffer sizes are whole MiB, so that batches of slightly different sizes share one."""


class StagingStats(NamedTuple):
    """A snapshot of a :class:`StagingBuffer`."""

    nbytes: int
    """Bytes allocated on the device now (0 before the first use and after close)."""
    uses: int
    """Batches moved through it."""
    allocations: int
    """How many times it was (re)allocated: it grows, it does not shrink."""


class StagingBuffer:
    """A reusable byte buffer on one device for staged transfers.

    Args:
        device: where the serving engine's KV caches live (the buffer is allocated there).
        max_bytes: the size a batch is split at: a batch whose payloads take more is moved
            in several passes through the buffer. A single payload larger than this still
            moves in one pass (the buffer grows to hold it).
        host_granule: when the host payloads are allocations of whole granules of this many
            bytes (a :class:`~lmcache_async.memory.pool.MemoryPool`'s ``page_size``), the bytes
            from a payload's end to the next granule boundary belong to the payload's own
            allocation: two payloads one granule-rounded size apart are then one host range,
            moved by one copy together with that slack. ``None``: only payloads exactly
            back to back are.

    Raises:
        InvalidInputError: ``max_bytes`` is not a positive int, or ``host_granule`` is not a
            positive multiple of 256.
    """

    def __init__(
        self,
        device: torch.device | str,
        *,
        max_bytes: int = DEFAULT_STAGING_BYTES,
        host_granule: int | None = None,
    ) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise InvalidInputError(f"max_bytes: expected a positive int, got {max_bytes!r}")
        if host_granule is not None and (
            isinstance(host_granule, bool)
            or not isinstance(host_granule, int)
            or host_granule <= 0
            or host_granule % _GRANULE_ALIGNMENT
        ):
            raise InvalidInputError(
                f"host_granule: expected None or a positive multiple of {_GRANULE_ALIGNMENT}, "
                f"got {host_granule!r}"
            )
        self._device = torch.device(device)
        self._max_bytes = max_bytes
        self._host_granule = host_granule
        self._cuda = self._device.type == "cuda"
        self._lock = threading.Lock()
        self._tensor: torch.Tensor | None = None
        self._home: Any = None  # the stream the tensor was allocated on
        self._recorded: set[Any] = set()  # other streams it was used on (record_stream)
        self._event: Any = None  # recorded behind the last use, on ``_last``
        self._last: Any = None
        self._uses = 0
        self._allocations = 0
        self._closed = False

    @property
    def device(self) -> torch.device:
        """Where the buffer lives."""
        return self._device

    @property
    def max_bytes(self) -> int:
        """The size a batch is split at (see the class doc)."""
        return self._max_bytes

    @property
    def host_granule(self) -> int | None:
        """The granule of the host payloads' allocations, if they have one."""
        return self._host_granule

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def statistics(self) -> StagingStats:
        """Bytes held now, batches moved, allocations made."""
        tensor = self._tensor
        return StagingStats(0 if tensor is None else tensor.numel(), self._uses, self._allocations)

    @contextlib.contextmanager
    def use(self, nbytes: int) -> Iterator[torch.Tensor]:
        """The buffer, as a ``uint8`` tensor of at least ``nbytes`` (a whole number of MiB),
        for one batch queued on the current stream while the block runs.

        Other users wait for the block to end. On CUDA the work queued in the block comes
        after the previous use's work, whichever stream that ran on; growing the buffer
        frees the old one only once the work queued on it has run (the caching
        allocator's stream order).

        Raises:
            EngineClosedError: the buffer was closed.
        """
        with self._lock:
            if self._closed:
                raise EngineClosedError("staging buffer is closed")
            stream = torch.cuda.current_stream(self._device) if self._cuda else None
            if stream is not None and self._last is not None and self._last != stream:
                stream.wait_event(self._event)
            tensor = self._reserve(nbytes, stream)
            self._uses += 1
            try:
                yield tensor
            finally:
                if stream is not None:
                    self._mark(stream)

    def close(self) -> None:
        """Free the buffer (once a use under way has ended) and refuse further uses.

        Idempotent. Copies still queued on the device keep the memory until they have run:
        the caching allocator hands it out again only in stream order.
        """
        with self._lock:
            self._closed = True
            self._tensor = None
            self._recorded.clear()
            self._event = self._last = self._home = None

    def __enter__(self) -> StagingBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------

    def _reserve(self, nbytes: int, stream: Any) -> torch.Tensor:
        """A tensor of at least ``nbytes``: the one held, or a larger one in its place."""
        tensor = self._tensor
        if tensor is not None and tensor.numel() >= nbytes:
            if stream is not None and stream != self._home and stream not in self._recorded:
                tensor.record_stream(stream)
                self._recorded.add(stream)
            return tensor
        size = -(-max(nbytes, 1) // _ROUNDING) * _ROUNDING
        if tensor is not None:
            # Grow geometrically up to the bound, so a run of growing batches reallocates a
            # few times, not once per batch.
            size = max(size, min(2 * tensor.numel(), self._max_bytes))
        self._tensor = None  # the old memory may serve the new allocation
        self._recorded.clear()
        tensor = torch.empty(size, dtype=torch.uint8, device=self._device)
        self._tensor, self._home = tensor, stream
        self._allocations += 1
        return tensor

    def _mark(self, stream: Any) -> None:
        """Record, behind the work just queued on ``stream``, the event the next use on
        another stream waits for."""
        if self._event is None:
            self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        self._event.record(stream)
        self._last = stream
