"""The serving engine's prefill speed, measured by the worker from vLLM's steps.

The cost model weighs a load against recomputing the same tokens
(:class:`~lmcache_async.engine.costs.LoadCosts`), so it needs vLLM's prefill speed. Each step
the worker sees begin (vLLM binds the connector metadata, which says how many tokens the
step computes) and end (``wait_for_save``, after the forward pass). A :class:`StepTimer`
times that window on the host clock, less the time spent inside this connector's own
calls; a :class:`CudaStepTimer` times it on the GPU stream, where the forward runs
asynchronously to the host. :class:`PrefillMeter` keeps an exponential moving average of
tokens per second over the steps that computed at least a chunk's worth of tokens (mostly
prefill), or the speed given in the configuration (``prefill_tokens_per_s``).
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Final

import torch

__all__ = ["DEFAULT_WEIGHT", "CudaStepTimer", "PrefillMeter", "StepTimer"]

DEFAULT_WEIGHT: Final = 0.2
"""Weight of the newest step in the moving average."""

_PENDING_WINDOWS: Final = 8
"""GPU-timed steps kept until their end event has completed (older ones are dropped)."""


class PrefillMeter:
    """Prefill tokens per second: ``fixed`` when given, else the moving average of the
    steps observed with at least ``min_tokens`` tokens (None until one was).

    Raises:
        ValueError: ``min_tokens`` < 1, ``weight`` outside (0, 1], ``fixed`` not > 0.
    """

    def __init__(
        self, *, min_tokens: int, fixed: float | None = None, weight: float = DEFAULT_WEIGHT
    ) -> None:
        if min_tokens < 1:
            raise ValueError(f"min_tokens must be >= 1, got {min_tokens}")
        if not 0 < weight <= 1:
            raise ValueError(f"weight must be in (0, 1], got {weight}")
        if fixed is not None and not fixed > 0:
            raise ValueError(f"fixed must be > 0, got {fixed}")
        self._min_tokens = min_tokens
        self._fixed = fixed
        self._weight = weight
        self._average: float | None = None
        self._samples = 0

    @property
    def min_tokens(self) -> int:
        """Tokens a step must compute to be counted."""
        return self._min_tokens

    @property
    def samples(self) -> int:
        """Steps counted so far."""
        return self._samples

    def observe(self, tokens: int, seconds: float) -> None:
        """A step that computed ``tokens`` in ``seconds``; counted when it computed at
        least ``min_tokens`` (a prefill-heavy step) in a positive time."""
        if tokens < self._min_tokens or not seconds > 0:
            return
        speed = tokens / seconds
        average = self._average
        self._average = speed if average is None else average + self._weight * (speed - average)
        self._samples += 1

    def tokens_per_s(self) -> float | None:
        """The prefill speed to weigh loads against (None: unknown yet). Safe to call
        from any thread."""
        if self._fixed is not None:
            return self._fixed
        return self._average


class StepTimer:
    """Times vLLM's steps on the host clock for a :class:`PrefillMeter`: from
    :meth:`started` to :meth:`ended`, less the time spent in :meth:`excluded` blocks (this
    connector's own loads within the step). ``clock``: seconds, monotonic."""

    def __init__(
        self, meter: PrefillMeter, *, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self._meter = meter
        self._clock = clock
        self._tokens = 0
        self._began: float | None = None
        self._excluded = 0.0

    def started(self, tokens: int) -> None:
        """A step computing ``tokens`` tokens begins (a step never ended is dropped)."""
        self._tokens = tokens
        self._began = self._clock()
        self._excluded = 0.0

    @contextlib.contextmanager
    def excluded(self) -> Iterator[None]:
        """Time spent inside is not the serving engine's (outside a step: ignored)."""
        began = self._clock()
        try:
            yield
        finally:
            if self._began is not None:
                self._excluded += self._clock() - began

    def ended(self) -> None:
        """The step's forward pass is over: its time goes to the meter."""
        began = self._began
        if began is None:
            return
        self._began = None
        self._meter.observe(self._tokens, self._clock() - began - self._excluded)


class CudaStepTimer(StepTimer):
    """Times vLLM's steps on the current CUDA stream of ``device``: events recorded where a
    step of at least the meter's ``min_tokens`` begins and ends, read once the GPU has
    passed the end (at a later call; the host never waits for it). GPU time is what it
    is: :meth:`excluded` blocks are not subtracted (an asynchronous load's start does not
    hold the stream; a layerwise transfer's wait does, and counts as step time)."""

    def __init__(self, meter: PrefillMeter, device: torch.device) -> None:
        super().__init__(meter)
        self._device = device
        self._start: torch.cuda.Event | None = None
        self._windows: collections.deque[tuple[int, torch.cuda.Event, torch.cuda.Event]] = (
            collections.deque(maxlen=_PENDING_WINDOWS)
        )

    def _event(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self._device))
        return event

    def _read(self) -> None:
        """Count the steps the GPU has finished, oldest first."""
        while self._windows and self._windows[0][2].query():  # type: ignore[no-untyped-call]
            tokens, start, end = self._windows.popleft()
            self._meter.observe(tokens, start.elapsed_time(end) / 1000)

    def started(self, tokens: int) -> None:
        self._read()
        super().started(tokens)
        self._start = self._event() if tokens >= self._meter.min_tokens else None

    def ended(self) -> None:
        start, self._start = self._start, None
        self._began = None
        if start is not None:
            self._windows.append((self._tokens, start, self._event()))
        self._read()
