"""How a request runs: in the caller's task or through a pipeline, always within a deadline.

:class:`Runner` decides whether a request is small work that does not wait (run inline,
through every stage's handler in the caller's task) or goes through the pipeline's stage
tasks, bounds it by its timeout, and on timeout or cancellation abandons it so that when
the caller gets control back nothing of the request still touches its memory.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TypeVar

import anyio

from lmcache_async.logging import get_logger

from ..backends.manager import StorageManager
from ..errors import EngineClosedError, InvalidInputError
from ..pipelines.common import Request
from ..pipelines.stage import Completion, Pipeline
from ..stats import Counters

__all__ = ["Runner"]

log = get_logger(__name__)

T = TypeVar("T")

# How long a request that timed out waits for a copy already under way, so that what it
# returns covers every slot that was written.
_ABANDON_GRACE_SECONDS = 10.0


class Runner:
    """Runs requests through pipelines for one engine."""

    def __init__(
        self,
        manager: StorageManager,
        counters: Counters,
        *,
        token_bytes: int,
        inline_copy_bytes: int,
    ) -> None:
        self._manager = manager
        self._counters = counters
        self._token_bytes = token_bytes
        self._inline_copy_bytes = inline_copy_bytes

    def runs_inline(self, request: Request, locations: Sequence[str] | None) -> bool:
        """Whether ``request`` is small work that does not wait: hashed already, copied on
        the event loop (CPU memory, fewer than ``inline_copy_bytes``) and served by the CPU
        tier alone. Such a request runs in the caller's task, without a hop between the
        pipeline's stage tasks (each a pass of the event loop)."""
        return (
            request.hash_inline
            and request.plan.device.type == "cpu"
            and request.num_tokens * self._token_bytes < self._inline_copy_bytes
            and not self._manager.reads_slow_tiers(locations)
        )

    async def execute(
        self,
        pipeline: Pipeline,
        request: Request,
        completion: Completion[T],
        timeout: float,
        *,
        inline: bool = False,
    ) -> T | None:
        """Run ``request`` through ``pipeline``; None when it timed out or failed.

        A request resolves only once every batch of it is accounted for. On timeout or
        cancellation the request is marked, so the stages drop what remains and return its
        memory, and the caller waits (bounded, shielded) for a copy already under way: when
        this returns or raises, nothing of the request still touches the caller's memory.

        Raises:
            InvalidInputError: input found invalid off the loop.
            EngineClosedError: the engine closed under the request.
        """
        submitted = False
        deadline = asyncio.timeout(timeout)
        try:
            # asyncio's own timeout: an anyio cancel scope costs tens of microseconds, paid
            # on every request.
            async with deadline:
                if inline:
                    # In this task (see runs_inline): its only wait is for host memory,
                    # which the stage waiting hands back at the deadline or a cancellation;
                    # its copies run on the loop, so none is under way when it stops.
                    await pipeline.run_inline(request)
                    if not completion.done:  # every batch went through the last stage
                        raise RuntimeError("an inline request did not finish")
                    return completion.result()
                await pipeline.submit(request)
                submitted = True
                return await completion.wait()
        except TimeoutError:
            if not deadline.expired():
                # A TimeoutError from inside the pipeline (a GPU copy overdue): a failure.
                self._counters.failed_requests += 1
                log.exception("request_failed", req_id=request.req_id, pipeline=pipeline.name)
                return None
            self._counters.timed_out_requests += 1
            log.warning("request_timed_out", req_id=request.req_id, pipeline=pipeline.name)
            await self._abandon(request, completion, submitted)
            return None
        except (EngineClosedError, InvalidInputError):
            raise
        except Exception:
            self._counters.failed_requests += 1
            log.exception("request_failed", req_id=request.req_id, pipeline=pipeline.name)
            return None
        except BaseException:
            await self._abandon(request, completion, submitted)
            raise

    @staticmethod
    async def _abandon(request: Request, completion: Completion[T], submitted: bool) -> None:
        """Drop what remains of ``request`` and wait for a copy of it already under way."""
        request.cancel()
        if not submitted:
            return
        with anyio.move_on_after(_ABANDON_GRACE_SECONDS, shield=True):
            await completion.wait_done()
        if not completion.done:
            log.error(
                "request_abandoned_with_copy_in_flight",
                req_id=request.req_id,
                grace_seconds=_ABANDON_GRACE_SECONDS,
            )
