"""The worker's loads between steps: vLLM's asynchronous loads (``load_async=True``).

vLLM holds a request whose load is asynchronous out of its steps (``WAITING_FOR_REMOTE_KVS``)
until every worker reports the load finished. :class:`AsyncLoads` starts each load in the
background on the cache engine's thread (:meth:`SyncCacheEngine.retrieve_soon
<lmcache_async.SyncCacheEngine.retrieve_soon>`, bounded by ``load_timeout``), and each step
reports the loads whose retrieve is over, with the blocks they did not fill, which vLLM
recomputes (:func:`unfilled_blocks`). Only a retrieve that is over is reported: once vLLM
is told, nothing writes into the request's blocks any more.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Final

import torch

from lmcache_async.errors import InvalidInputError
from lmcache_async.logging import get_logger
from lmcache_async.sync.engine import SyncCacheEngine

from .metadata import LoadSpec

__all__ = ["IDLE_STEP_WAIT", "AsyncLoads", "unfilled_blocks"]

log = get_logger(__name__)

IDLE_STEP_WAIT: Final = 0.005
"""Seconds a step that computes nothing waits for a load under way before it reports:
vLLM runs such steps back to back while a request waits for its KV, and a loop that never
lets go of the interpreter starves the load it waits for."""

STUCK_GRACE: Final = 1.0
"""Seconds past ``load_timeout`` after which a load still not over is logged as stuck (the
engine's thread is blocked); it is still not reported, as it may yet write."""


def unfilled_blocks(load: LoadSpec, loaded: torch.Tensor | None, block_size: int) -> set[int]:
    """The blocks of ``load`` its retrieve did not fill: from the block of the first token
    of ``[start, end)`` not loaded to the block of ``end - 1`` (``loaded``: the retrieve's
    mask, None when it failed: every block of the load). Logged."""
    filled = load.start
    if loaded is not None:
        missing = (~loaded[load.start : load.end]).nonzero()
        filled = load.end if missing.numel() == 0 else load.start + int(missing[0])
    if filled >= load.end:
        log.debug("vllm_kv_loaded", req_id=load.req_id, tokens=load.end - load.start)
        return set()
    bad = set(load.block_ids[filled // block_size : (load.end - 1) // block_size + 1])
    log.warning(
        "vllm_kv_load_incomplete",
        req_id=load.req_id,
        promised=load.end - load.start,
        loaded=filled - load.start,
        blocks=len(bad),
    )
    return bad


@dataclass(eq=False, slots=True)
class _InFlight:
    """A load started and not yet reported."""

    load: LoadSpec
    future: concurrent.futures.Future[torch.Tensor]
    stuck_at: float  # when it is overdue (load_timeout + STUCK_GRACE after its start)
    finished: bool = False  # vLLM finished the request meanwhile: its blocks are not reported
    stuck_logged: bool = False


class AsyncLoads:
    """A worker's asynchronous loads: started by :meth:`start`, reported by :meth:`poll`.

    ``timeout``: seconds each retrieve may take (``load_timeout``); ``clock`` tells the time
    for the log of a load overdue.
    """

    def __init__(
        self,
        *,
        block_size: int,
        chunk_size: int,
        timeout: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._block_size = block_size
        self._chunk_size = chunk_size
        self._timeout = timeout
        self._clock = clock
        self._in_flight: list[_InFlight] = []

    def __len__(self) -> int:
        """Loads started and not yet reported."""
        return len(self._in_flight)

    def start(
        self, engine: SyncCacheEngine | None, kv_caches: Sequence[torch.Tensor], load: LoadSpec
    ) -> None:
        """Start ``load`` into ``kv_caches`` and return at once. A load that cannot start
        (no engine, bad blocks, the engine closed) is reported failed at the next
        :meth:`poll`."""
        try:
            if engine is None:
                raise InvalidInputError("KV caches were never registered")
            arguments = load.retrieve_args(
                kv_caches, block_size=self._block_size, chunk_size=self._chunk_size
            )
            future = engine.retrieve_soon(load.tokens, timeout=self._timeout, **arguments)
        except Exception as exc:
            log.exception("vllm_load_failed", req_id=load.req_id)
            if engine is not None:  # no retrieve ran to release the promise's pins
                with contextlib.suppress(Exception):
                    engine.lookup_unpin(load.req_id)
            future = concurrent.futures.Future()
            future.set_exception(exc)
        stuck_at = self._clock() + self._timeout + STUCK_GRACE
        self._in_flight.append(_InFlight(load, future, stuck_at))

    def poll(self, finished_req_ids: Iterable[str] = ()) -> tuple[set[str], set[int]]:
        """The requests whose loads are over (vLLM's ``finished_recving``) and the blocks
        those loads did not fill (vLLM's invalid blocks, due in the same step). A load that
        failed (timed out, the sidecar gone) leaves every block of it unfilled.
        ``finished_req_ids``: requests vLLM finished (aborted) meanwhile; their loads are
        still reported once over (vLLM keeps their blocks until then), their blocks not."""
        finished = set(finished_req_ids)
        now = self._clock()
        done: set[str] = set()
        bad: set[int] = set()
        left: list[_InFlight] = []
        for entry in self._in_flight:
            req_id = entry.load.req_id
            entry.finished = entry.finished or req_id in finished
            if not entry.future.done():
                if now >= entry.stuck_at and not entry.stuck_logged:
                    entry.stuck_logged = True
                    log.error("vllm_async_load_stuck", req_id=req_id, timeout=self._timeout)
                left.append(entry)
                continue
            blocks = unfilled_blocks(entry.load, _mask(entry), self._block_size)
            if not entry.finished:
                bad |= blocks
            done.add(req_id)
        self._in_flight = left
        done -= {entry.load.req_id for entry in left}  # reported once all its loads are over
        return done, bad

    def wait_any(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for any load under way to be over (none under
        way: return at once)."""
        futures = [entry.future for entry in self._in_flight]
        if futures:
            concurrent.futures.wait(
                futures, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED
            )

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for every load started to be over (to be reported
        by the next :meth:`poll`); True when they are."""
        futures = [entry.future for entry in self._in_flight]
        _, not_done = concurrent.futures.wait(futures, timeout=timeout)
        return not not_done

    def close(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the loads under way, then cancel the rest
        (the engine's thread ends them, a copy under way first); none is reported."""
        self.wait(timeout)
        left = [entry for entry in self._in_flight if not entry.future.done()]
        self._in_flight = []
        for entry in left:
            entry.future.cancel()
        if left:
            log.warning("vllm_async_loads_cancelled", loads=len(left))


def _mask(entry: _InFlight) -> torch.Tensor | None:
    """A finished load's mask; None (logged) when it failed or was cancelled."""
    future = entry.future
    if future.cancelled():
        log.warning("vllm_async_load_cancelled", req_id=entry.load.req_id)
        return None
    exc = future.exception()
    if exc is not None:
        log.warning("vllm_async_load_failed", req_id=entry.load.req_id, error=repr(exc))
        return None
    return future.result()
