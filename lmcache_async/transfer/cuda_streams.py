"""The caller's stream: where a request's KV is produced (a store) or consumed (a load).

A serving engine computes on a stream of its choosing, and not on the engine's thread:
through :class:`~lmcache_async.sync.engine.SyncCacheEngine` the forward pass runs on the
caller's thread, the copies on the engine's. A request's copies are therefore ordered
against the stream the caller names (by default its current stream, taken on its thread
when it calls): the copy stream waits for a point recorded on that stream when the
request was made (a store sees the caller's last write of the KV), and after a load the
caller's stream waits for the copies (its next kernels read the loaded KV).

Nothing here runs for caches on the CPU: :func:`caller_stream` and :func:`current_stream`
look at the device first and make no ``torch.cuda`` call for the CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lmcache_async.errors import InvalidInputError

__all__ = ["CallerStream", "caller_stream", "current_stream"]


class CallerStream:
    """One request's caller stream and the point on it its copies come after.

    ``stream`` is the caller's ``torch.cuda.Stream``. The copy stream waits for an event
    recorded on it when the request was made and, when the request's transfer plan was
    built on another stream (the engine thread's current one), for an event recorded
    there after the plan (its row indices live on the device).
    """

    __slots__ = ("_built", "_consumes", "_ready", "stream")

    def __init__(
        self, stream: Any, ready: Any, built: Any | None, *, consumes: bool = True
    ) -> None:
        self.stream = stream
        self._ready = ready
        self._built = built
        self._consumes = consumes

    def order(self, copy_stream: Any) -> None:
        """Make ``copy_stream`` wait for the caller's point (and the request's plan)."""
        copy_stream.wait_event(self._ready)
        if self._built is not None:
            copy_stream.wait_event(self._built)

    def consume(self, done: Any) -> None:
        """Make the caller's stream wait for the event ``done`` (behind a load's copies),
        so what the caller queues next reads the loaded KV; nothing for a point made by
        :meth:`handed_over`."""
        if self._consumes:
            self.stream.wait_event(done)

    def mark(self) -> CallerStream:
        """The same stream at a point recorded now: a layerwise store's step, queued
        after the caller's compute of that layer."""
        return CallerStream(self.stream, _record(self.stream), self._built)

    def handed_over(self) -> CallerStream:
        """The same point, for copies whose completion the caller is handed by a step
        that waited for it (a layerwise load's layers): its stream is made to wait for
        none of them. A wait queued with layer *i + 1*'s copy would hold the caller's
        compute of layer *i*, queued after it, behind that copy."""
        return CallerStream(self.stream, self._ready, self._built, consumes=False)


def caller_stream(device: torch.device, stream: Any | None = None) -> CallerStream | None:
    """The point, now, on the stream of a request over caches on ``device``: ``stream``,
    or the calling thread's current stream of ``device`` when None. None for caches that
    are not on a CUDA device (``stream`` is then ignored, and no ``torch.cuda`` call made).

    Raises:
        InvalidInputError: ``stream`` is not a ``torch.cuda.Stream`` of ``device``.
    """
    if device.type != "cuda":
        return None
    current = torch.cuda.current_stream(device)
    if stream is None:
        stream = current
    elif not isinstance(stream, torch.cuda.Stream) or stream.device != current.device:
        raise InvalidInputError(f"stream must be a torch.cuda.Stream on {current.device}")
    # The plan's indices were built on this thread's current stream just before.
    built = None if stream == current else _record(current)
    return CallerStream(stream, _record(stream), built)


def current_stream(kv_caches: object) -> torch.cuda.Stream | None:
    """The calling thread's current stream on the device of ``kv_caches`` (its first
    tensor), or None when they are not CUDA tensors (checked in full later, by the
    engine)."""
    if isinstance(kv_caches, torch.Tensor) or not isinstance(kv_caches, Sequence):
        return None
    first = kv_caches[0] if kv_caches else None
    if not isinstance(first, torch.Tensor) or first.device.type != "cuda":
        return None
    return torch.cuda.current_stream(first.device)


def _record(stream: Any) -> Any:
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(stream)
    return event
