"""One replay of a trace against a target whose tiers have given sizes.

The target is opened fresh for each replay, so every replay starts from an empty cache:
an embedded :class:`~lmcache_async.CacheEngine`, a sidecar (the one at ``url``, as it is,
or one started for the replay the way ``bench --sidecar`` starts it, and stopped after) or
vLLM with the connector. Its configuration is the caller's with the trace's chunking and
the tier sizes asked for (:func:`~.sizing.sized_config`); a disk tier gets a directory of
its own, removed after.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final, TextIO

import anyio

from lmcache_async import EngineConfig, KVLayout, TierUnavailableError
from lmcache_async.bench.loadgen.options import VLLM_OPERATIONS, LoadOptions
from lmcache_async.bench.loadgen.runner import CacheRunner, VllmRunner
from lmcache_async.bench.loadgen.tally import Tally
from lmcache_async.bench.loadgen.targets import Target, open_target
from lmcache_async.bench.routing.ports import log_tail
from lmcache_async.bench.scale.fill import FillProgress
from lmcache_async.bench.sidecar import sidecar_process
from lmcache_async.bench.trace.bounds import TraceScan
from lmcache_async.bench.trace.options import TraceOptions
from lmcache_async.bench.trace.parse import TraceRequest, read_trace
from lmcache_async.bench.trace.replay import Step, beside_step, cache_step, replay, vllm_step
from lmcache_async.bench.trace.sizing import ChunkSize, check_block_size, sized_config
from lmcache_async.bench.trace.tokens import BlockTokens
from lmcache_async.bench.vllm_target import open_vllm, read_model
from lmcache_async.errors import InvalidInputError
from lmcache_async.logging import get_logger

__all__ = ["Replayed", "TierSizes", "replay_at"]

log = get_logger(__name__)

STARTUP_TIMEOUT: Final = 120.0
"""Seconds a sidecar started for a replay may take to answer (torch imports slowly)."""


@dataclass(frozen=True, slots=True)
class TierSizes:
    """The tiers of one replay, in chunks (None: the configuration's, or no disk tier)."""

    cpu_chunks: int | None
    disk_chunks: int | None = None
    disk_record: int | None = None
    """Bytes of one chunk's record on disk (with ``disk_chunks``)."""


@dataclass(slots=True)
class Replayed:
    """What one replay leaves: its counts, its time and the target's state."""

    tally: Tally
    wall: float
    stats: dict[str, Any]
    """The engine's statistics at the end, as plain data (empty when it gave none)."""
    cached_chunks_at_start: int | None
    config: EngineConfig | None
    """The engine's configuration (None: a sidecar's own, at ``url``)."""
    chunk_size: int | None
    url: str | None = None
    vllm: dict[str, Any] = field(default_factory=dict)
    beside: Tally | None = None
    """The same requests' counts on an embedded engine (``--beside-embedded``)."""


async def replay_at(
    options: TraceOptions,
    base: EngineConfig,
    sizes: TierSizes,
    *,
    scan: TraceScan,
    tokens: BlockTokens,
    layout: KVLayout,
    chunk: ChunkSize,
    label: str,
    stream: TextIO | None,
) -> Replayed:
    """Replay the trace once against a fresh target of ``sizes`` (progress lines on
    ``stream``, headed ``label``).

    Raises:
        InvalidInputError: the sidecar's chunk size is not the block size, it serves
            another namespace, a line of the trace is bad, or vLLM cannot take the prompts.
        ConfigError: the engine refuses the configuration.
        TierUnavailableError: the sidecar does not answer.
    """
    async with contextlib.AsyncExitStack() as stack:
        directory = None
        if sizes.disk_chunks is not None:
            directory = stack.enter_context(
                tempfile.TemporaryDirectory(prefix="lmc-trace-disk-", dir=options.work_dir)
            )
        config = sized_config(
            base,
            chunk,
            cpu_chunks=sizes.cpu_chunks,
            disk_chunks=sizes.disk_chunks,
            disk_record=sizes.disk_record,
            disk_directory=directory,
        )
        progress = FillProgress(stream, label, scan.requests, "requests") if stream else None
        requests = read_trace(options.path, block_size=options.block_size, limit=options.limit)
        job = _Job(options, config, scan, tokens, requests, progress)
        if options.target == "vllm":
            done = await _replay_vllm(job)
        else:
            url, log_path = options.url, None
            if options.target == "sidecar" and url is None:
                url, log_path = await stack.enter_async_context(_started_sidecar(config))
            done = await _replay_cache(job, url, layout, log_path)
        if progress is not None:
            progress.finish()
        return done


@contextlib.asynccontextmanager
async def _started_sidecar(config: EngineConfig) -> AsyncIterator[tuple[str, Path]]:
    """A sidecar process serving ``config`` for the replay (``bench --sidecar``'s way);
    yields its URL and its log's path, stops it after."""
    with tempfile.TemporaryDirectory(prefix="lmc-trace-") as directory:
        async with sidecar_process(config, directory) as url:
            yield url, Path(directory) / "sidecar.log"


@contextlib.asynccontextmanager
async def _connected(
    load: LoadOptions, config: EngineConfig, layout: KVLayout, log_path: Path | None
) -> AsyncIterator[Target]:
    """:func:`~lmcache_async.bench.loadgen.targets.open_target`; a sidecar just started
    (``log_path``: its log) is asked again until it answers, for ``STARTUP_TIMEOUT``.

    Raises:
        TierUnavailableError: no answer (with the end of the started sidecar's log).
    """
    if log_path is None:
        async with open_target(load, config, layout) as target:
            yield target
        return
    # Each try is bounded by the client's timeout; no cancel scope may wrap the entry of
    # the client's context, whose task group outlives it.
    deadline = anyio.current_time() + STARTUP_TIMEOUT
    async with contextlib.AsyncExitStack() as stack:
        while True:
            try:
                target = await stack.enter_async_context(open_target(load, config, layout))
                break
            except TierUnavailableError:
                if anyio.current_time() > deadline:
                    tail = log_tail(log_path, 4000)
                    raise TierUnavailableError(f"the sidecar did not start:\n{tail}") from None
        yield target


@dataclass(frozen=True, slots=True)
class _Job:
    """One replay's settings and the requests it reads."""

    options: TraceOptions
    config: EngineConfig
    scan: TraceScan
    tokens: BlockTokens
    requests: Iterator[TraceRequest]
    progress: FillProgress | None

    async def replay(self, step: Step, tally: Tally) -> float:
        options = self.options
        return await replay(
            self.requests,
            step,
            tokens=self.tokens,
            tally=tally,
            concurrency=options.concurrency,
            speed=options.speed,
            request_timeout=options.request_timeout,
            progress=self.progress,
        )


async def _replay_cache(
    job: _Job, url: str | None, layout: KVLayout, log_path: Path | None
) -> Replayed:
    """The replay against an embedded engine or a sidecar (see :func:`replay_at`)."""
    options, config, tokens = job.options, job.config, job.tokens
    load = options.load_options(url=url, vocab_size=tokens.vocab_size)
    tally = Tally()
    beside: Tally | None = None
    async with contextlib.AsyncExitStack() as stack:
        target = await stack.enter_async_context(_connected(load, config, layout, log_path))
        where = "the engine" if url is None else f"the sidecar at {url}"
        check_block_size(target.chunk_size, options.block_size, where)
        before = await target.stats()

        def runner_of(opened: Target, counted: Tally, of: LoadOptions) -> CacheRunner:
            slots, longest = options.concurrency, max(1, job.scan.max_prompt_tokens)
            return CacheRunner(
                of, layout, opened, slots=slots, max_prompt_tokens=longest, tally=counted
            )

        runner = runner_of(target, tally, load)
        step = cache_step(runner)
        if options.beside_embedded:
            if config.local_disk is not None:
                raise InvalidInputError("--beside-embedded takes an engine without a disk tier")
            beside, local = Tally(), replace(load, target="embedded", url=None)
            embedded = await stack.enter_async_context(open_target(local, config, layout))
            step = beside_step(runner, runner_of(embedded, beside, local))
        wall = await job.replay(step, tally)
        stats = await target.stats()
    tally.count_engine_errors(stats)
    started_own = options.target == "embedded" or options.url is None
    return Replayed(
        tally=tally,
        wall=wall,
        stats=stats,
        cached_chunks_at_start=before.get("cached_chunks"),
        config=config if started_own else None,
        chunk_size=target.chunk_size,
        url=url,
        beside=beside,
    )


async def _replay_vllm(job: _Job) -> Replayed:
    """The replay against vLLM with the connector (see :func:`replay_at`)."""
    options, config, scan = job.options, job.config, job.scan
    model = read_model(options.model)
    max_model_len = max(1, scan.max_prompt_tokens) + options.max_tokens
    if model.max_positions is not None and max_model_len > model.max_positions:
        raise InvalidInputError(
            f"the trace's longest prompt ({scan.max_prompt_tokens} tokens) and "
            f"{options.max_tokens} generated exceed the model's max_position_embeddings "
            f"({model.max_positions})"
        )
    load = options.load_options(vocab_size=job.tokens.vocab_size)
    tally = Tally(operations=VLLM_OPERATIONS)
    sidecar_url = options.url if options.connector else None
    async with open_vllm(
        load.vllm_settings(), config, max_model_len=max_model_len, sidecar_url=sidecar_url
    ) as target:
        runner = VllmRunner(target, tally)
        wall = await job.replay(vllm_step(runner, options.max_tokens), tally)
        try:
            stats = await target.stats()
        except Exception as exc:  # the statistics are a report, not the measurement
            log.warning("bench_trace_vllm_stats_failed", error=repr(exc))
            stats = {}
        connector = "sidecar" if sidecar_url else "embedded"
        run = {
            "model": model.path,
            "vocab_size": model.vocab_size,
            "max_model_len": max_model_len,
            "startup_seconds": target.startup_seconds,
            "connector": connector if options.connector else "none",
        }
        chunk_size = target.chunk_size
    return Replayed(
        tally=tally,
        wall=wall,
        stats=stats,
        cached_chunks_at_start=None,
        config=config if sidecar_url is None and options.connector else None,
        chunk_size=chunk_size,
        url=sidecar_url,
        vllm=run,
    )
