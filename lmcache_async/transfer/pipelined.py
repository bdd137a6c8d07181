"""Double-buffered staged transfers: a batch's kernels on one stream, its host copies on another.

:class:`~lmcache_async.transfer.staged.StagedPlan` moves a batch of chunks through one
staging buffer with a few kernels per layer and part, then one host copy per run of
adjacent payloads. Run on one stream, the kernels and the copies take turns: the link sits
idle while the batch is gathered. :func:`gather_pipelined` and :func:`scatter_pipelined`
cut the batch into a few passes and alternate them between the two buffers of a
:class:`Lanes`, so that pass *k + 1*'s kernels run while pass *k* crosses the link:

- a store gathers pass *k* on ``home`` (which comes after the caller's point), records an
  event; ``side`` waits for it and copies the pass to the host; before gathering pass
  *k + 2* into the same buffer, ``home`` waits for that copy's event;
- a load mirrors it: ``home`` copies pass *k* in from the host, ``side`` scatters it into
  engine memory, ``home`` waits for the scatter before reusing the buffer.

At the end ``home`` waits for ``side``'s last event, so what is queued on ``home`` next
(the completion event the caller awaits, a load's hand-over to the caller's stream, the
buffers' next use) comes after every copy and kernel of the batch. A store's time is then
its bytes at the link's speed plus one pass's gather; a load's, plus one pass's scatter.

Each pass costs what a :class:`StagedPlan` pass costs (a kernel per layer, part and chunk
length, a copy per host range), and a batch has at most :data:`DEFAULT_PASSES` passes (more
only when one would exceed a buffer's ``max_bytes``): its launches do not grow with its
number of chunks. The code is plain torch plus ``torch.cuda`` streams and events; the tests
drive it on the CPU with stand-in streams (``tests/fake_cuda.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import torch

from lmcache_async.transfer.staged import Job, Pass, StagedPlan
from lmcache_async.transfer.staging import StagingBuffer

__all__ = [
    "DEFAULT_MIN_PASS_BYTES",
    "DEFAULT_PASSES",
    "Lanes",
    "gather_pipelined",
    "scatter_pipelined",
]

DEFAULT_PASSES: Final = 4
"""A batch is cut into about this many passes: enough that one pass's kernels are a small
share of the batch's time, few enough that the launches stay a few per layer and part."""

DEFAULT_MIN_PASS_BYTES: Final = 4 * 1024**2
"""A pass carries at least this much (when the batch has it): a smaller one costs its
launches for too few bytes."""


@dataclass(frozen=True, slots=True)
class Lanes:
    """Where a direction's staged transfers run on one device: ``home`` (the direction's
    copy stream, ordered after the caller's point), ``side`` (a second stream) and two
    staging buffers used in turn."""

    home: Any
    side: Any
    slots: tuple[StagingBuffer, StagingBuffer]

    def close(self) -> None:
        for slot in self.slots:
            slot.close()


def pass_bound(total: int, max_bytes: int, *, passes: int, min_pass_bytes: int) -> int:
    """The bytes a pass of a batch of ``total`` bytes may carry: about ``total / passes``,
    at least ``min_pass_bytes``, at most ``max_bytes``."""
    return max(1, min(max_bytes, max(min_pass_bytes, -(-total // max(passes, 1)))))


def gather_pipelined(
    plan: StagedPlan,
    jobs: Sequence[Job],
    lanes: Lanes,
    *,
    passes: int | None = None,
    min_pass_bytes: int | None = None,
) -> None:
    """:meth:`StagedPlan.gather_chunks` on two streams (see the module doc), in about
    ``passes`` passes of at least ``min_pass_bytes`` (None: the defaults); called with
    ``lanes.home`` the current stream. The payloads are complete once ``home`` has reached
    what is queued on it next. On a failure the work queued on both streams is waited for
    before it is raised.

    Raises:
        InvalidInputError: a token of a job has a negative slot, a malformed job, or
            buffers on another device (nothing queued).
        EngineClosedError: a buffer was closed.
    """
    plan.refuse_negatives(jobs)
    steps = (plan.gather_kernels, plan.copy_out)
    _pipeline(plan, jobs, lanes, steps, passes=passes, min_pass_bytes=min_pass_bytes)


def scatter_pipelined(
    plan: StagedPlan,
    jobs: Sequence[Job],
    lanes: Lanes,
    *,
    passes: int | None = None,
    min_pass_bytes: int | None = None,
) -> None:
    """:meth:`StagedPlan.scatter_chunks` on two streams, in passes as
    :func:`gather_pipelined` (see the module doc): tokens with a
    negative slot are not written; keep the payloads unchanged until ``home`` has reached
    what is queued on it next. On a failure the work queued on both streams is waited for
    before it is raised.

    Raises:
        InvalidInputError: a malformed job, or buffers on another device (nothing queued).
        EngineClosedError: a buffer was closed.
    """
    steps = (plan.copy_in, plan.scatter_kernels)
    _pipeline(plan, jobs, lanes, steps, passes=passes, min_pass_bytes=min_pass_bytes)


_Step = Callable[[Pass, torch.Tensor], None]


def _pipeline(
    plan: StagedPlan,
    jobs: Sequence[Job],
    lanes: Lanes,
    steps: tuple[_Step, _Step],
    *,
    passes: int | None,
    min_pass_bytes: int | None,
) -> None:
    """Run ``steps[0]`` of each pass on ``home`` and ``steps[1]`` on ``side``, the passes
    in turn through the two buffers, with events between them (see the module doc)."""
    first, second = steps
    slot0 = lanes.slots[0]
    total = sum(payload.numel() * payload.element_size() for _, _, payload in jobs)
    bound = pass_bound(
        total,
        slot0.max_bytes,
        passes=DEFAULT_PASSES if passes is None else passes,
        min_pass_bytes=DEFAULT_MIN_PASS_BYTES if min_pass_bytes is None else min_pass_bytes,
    )
    batches = plan.passes(jobs, slot0, bound)
    plan.passes((), lanes.slots[1])  # the second buffer's device is checked too
    if not batches:
        return
    home, side = lanes.home, lanes.side
    nbytes = max(batch.nbytes for batch in batches)
    with contextlib.ExitStack() as stack:
        used = lanes.slots[: min(2, len(batches))]
        buffers = [stack.enter_context(slot.use(nbytes)) for slot in used]
        freed: list[Any] = [None, None]  # per buffer: the event behind its last reader
        try:
            for k, batch in enumerate(batches):
                slot = k % 2
                if freed[slot] is not None:
                    home.wait_event(freed[slot])
                first(batch, buffers[slot])
                side.wait_event(_record(home))
                with torch.cuda.stream(side):
                    second(batch, buffers[slot])
                freed[slot] = _record(side)
            home.wait_event(freed[(len(batches) - 1) % 2])
        except BaseException as exc:
            _settle(lanes, exc)
            raise


def _record(stream: Any) -> Any:
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(stream)
    return event


def _settle(lanes: Lanes, exc: BaseException) -> None:
    """After ``exc`` ended a pipelined transfer: wait for what it queued on both streams,
    so that no copy touches a payload once the caller, told of the failure, hands it
    back."""
    for stream in (lanes.side, lanes.home):
        try:
            stream.synchronize()
        except Exception as error:  # the device failed: the first error is the news
            exc.add_note(f"waiting for the copies already queued failed too: {error!r}")
