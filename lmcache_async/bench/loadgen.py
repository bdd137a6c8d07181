"""The async load generator behind ``lmcache-async bench``: a workload of requests against a
cache, on real KV tensors.

Each request does what a serving engine does with a prompt:

1. ``lookup`` the prompt, pinning the hit under a lookup id;
2. ``retrieve`` the cached prefix into paged KV memory (one tensor per layer, allocated
   once; each in-flight request owns a block range and maps a fresh block permutation of
   it, as a paged allocator would), or release the pin on a miss;
3. "compute" the rest: write the synthetic KV of the uncached tokens into their slots (the
   prefill; :class:`~lmcache_async.bench.workloads.KVSource`);
4. ``store`` the prompt, masking the chunks that came from the cache.

Every ``verify_every``-th retrieve is checked bit for bit (on a sample of its tokens)
against the KV the compute step would have written.

Targets: ``embedded`` (a :class:`~lmcache_async.CacheEngine` in this process),
``sidecar`` (a :class:`~lmcache_async.RemoteCacheEngine` connected to ``lmcache-async
serve``; its cache is left as it is at the end) and ``vllm``: vLLM's async engine on a local
model with the lmcache_async connector (:mod:`~lmcache_async.bench.vllm_target`; its cache
embedded in vLLM's worker, or the sidecar at ``url``). A vLLM request submits the prompt's
token ids and generates ``max_tokens`` tokens; the run times each request's first token
(``ttft``) and end (``request``) and counts the tokens the connector reports loaded and
stored; its hit rate is the loaded tokens over the prompt tokens.

Arrivals: with ``rate`` 0 (the default), ``concurrency`` requests are kept in flight
(closed loop); with a rate, requests arrive at that many per second (Poisson or evenly
spaced) and wait for a free slot when ``concurrency`` are already in flight; their
``request`` latency counts from the arrival. Results are plain data
(:func:`run_load`, also written as JSON); :func:`format_summary` renders them as text and
:func:`write_plot` draws latency and hit rate over the run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
import os
import random
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol, TextIO

import anyio
import structlog
import torch

from lmcache_async.bench import Progress, format_table, parse_dtype, percentiles, plain_data
from lmcache_async.bench.vllm_target import (
    VLLM_EXECUTORS,
    VllmSettings,
    VllmTarget,
    check_vllm,
    open_vllm,
    read_model,
)
from lmcache_async.bench.workloads import (
    WORKLOADS,
    KVSource,
    LongDocQA,
    MultiRoundChat,
    Prompt,
    RandomPrompts,
    Workload,
    same_bytes,
)
from lmcache_async.config import EngineConfig
from lmcache_async.engine import CacheEngine
from lmcache_async.errors import InvalidInputError
from lmcache_async.layouts import KVLayout
from lmcache_async.rpc.client import RemoteCacheEngine
from lmcache_async.tokens import Tokens

__all__ = [
    "ARRIVALS",
    "OPERATIONS",
    "TARGETS",
    "VLLM_OPERATIONS",
    "LoadOptions",
    "check_plotting",
    "format_summary",
    "run_load",
    "run_load_async",
    "write_plot",
]

log = structlog.get_logger(__name__)

TARGETS: Final = ("embedded", "sidecar", "vllm")
ARRIVALS: Final = ("poisson", "fixed")
OPERATIONS: Final = ("lookup", "retrieve", "compute", "store", "request")
"""Timed steps; ``request`` is a whole request, from its arrival to its store's end."""
VLLM_OPERATIONS: Final = ("ttft", "request")
"""Timed steps of a vLLM request, both from its arrival: its first token and its end."""

VERIFY_SAMPLE: Final = 256
"""Random tokens checked per verified retrieve (besides each chunk's first and last)."""

_GRACE_SECONDS: Final = 120.0
"""How long in-flight requests may run past ``duration`` before the run counts as hung."""
_SIDECAR_TIMEOUT: Final = 30.0
"""Seconds one sidecar request may take (a long prompt's KV is hundreds of MB)."""


@dataclass(frozen=True, slots=True)
class LoadOptions:
    """What to run, against what, and the model shape of the KV.

    The default model shape (16 layers, 8 KV heads of 64, bfloat16: 32 KiB of KV per token)
    is small enough for a 2-core machine and large enough that copies, not Python, dominate.
    """

    workload: str = "multi-round-chat"
    target: str = "embedded"
    url: str | None = None
    """The sidecar's ``ipc://`` or ``tcp://`` URL (target ``sidecar``; with target ``vllm``
    the connector keeps its cache there)."""
    model_name: str = "lmcache-async-bench"
    seed: int = 0
    duration: float = 8.0
    """Seconds during which new requests start; requests in flight then finish."""
    concurrency: int = 4
    rate: float = 0.0
    """Requests per second; 0: as fast as ``concurrency`` allows (closed loop)."""
    arrival: str = "poisson"
    users: int = 8
    system_prompt_tokens: int = 1024
    turn_tokens: int = 384
    """New tokens per turn (the previous answer plus the next question)."""
    max_context_tokens: int = 8192
    documents: int = 4
    questions: int = 4
    document_tokens: int = 2048
    question_tokens: int = 64
    min_prompt_tokens: int = 256
    max_prompt_tokens: int = 2048
    num_layers: int = 16
    num_kv_heads: int = 8
    head_size: int = 64
    dtype: str = "bfloat16"
    block_size: int = 16
    verify_every: int = 1
    """Check every n-th retrieve bit for bit on a sample of its tokens (0: never)."""
    vocab_size: int = 32000
    progress: bool = True
    """Show progress on stderr (tqdm when importable, else a line a second)."""
    model: str | None = None
    """Target ``vllm``: a local Hugging Face model directory."""
    max_tokens: int = 1
    """Target ``vllm``: tokens generated per request."""
    kv_cache_gb: float = 1.0
    """Target ``vllm``: vLLM's paged KV memory in GiB."""
    vllm_dtype: str = "auto"
    """Target ``vllm``: the model's dtype in vLLM (``auto``: the model config's)."""
    vllm_executor: str = "mp"
    """Target ``vllm``: ``mp`` (the worker in its own process) or ``uni``."""
    connector: bool = True
    """Target ``vllm``: False runs plain vLLM, a baseline without the cache."""

    def validate(self) -> None:
        """Check the options as a whole (the workload's sizes are checked by
        :meth:`make_workload`).

        Raises:
            InvalidInputError: an unknown name, a count or size out of range, an unknown
                dtype, a sidecar without a URL; for target ``vllm``: vLLM not installed,
                no usable ``model`` directory (the message says how to make one).
        """
        for name, value, allowed in (
            ("workload", self.workload, WORKLOADS),
            ("target", self.target, TARGETS),
            ("arrival", self.arrival, ARRIVALS),
            ("vllm_executor", self.vllm_executor, VLLM_EXECUTORS),
        ):
            if value not in allowed:
                raise InvalidInputError(f"{name} must be one of {', '.join(allowed)}: {value!r}")
        if self.target == "vllm":
            check_vllm()
            read_model(self.model)
            if self.max_tokens <= 0:
                raise InvalidInputError(f"max_tokens must be > 0, got {self.max_tokens}")
            if not (math.isfinite(self.kv_cache_gb) and self.kv_cache_gb > 0):
                raise InvalidInputError(f"kv_cache_gb must be > 0, got {self.kv_cache_gb!r}")
        if self.target == "sidecar" and not self.url:
            raise InvalidInputError("target sidecar needs the sidecar's url (--url)")
        positive = {
            "duration": self.duration,
            "concurrency": self.concurrency,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_size": self.head_size,
            "block_size": self.block_size,
        }
        for name, number in positive.items():
            if not number > 0:
                raise InvalidInputError(f"{name} must be > 0, got {number!r}")
        if not (math.isfinite(self.rate) and self.rate >= 0):
            raise InvalidInputError(f"rate must be a finite number >= 0, got {self.rate!r}")
        if self.verify_every < 0:
            raise InvalidInputError(f"verify_every must be >= 0, got {self.verify_every}")
        parse_dtype(self.dtype)

    def vllm_settings(self) -> VllmSettings:
        """The vLLM run of target ``vllm``.

        Raises:
            InvalidInputError: no ``model``.
        """
        if not self.model:
            read_model(self.model)  # raises, saying how to make a model
        return VllmSettings(
            model=str(self.model),
            max_tokens=self.max_tokens,
            kv_cache_gb=self.kv_cache_gb,
            dtype=self.vllm_dtype,
            executor=self.vllm_executor,
            connector=self.connector,
            seed=self.seed,
        )

    def layout(self) -> KVLayout:
        """The vLLM flash-attention layout of the benchmark model."""
        return KVLayout.vllm_flash_attn(
            num_layers=self.num_layers,
            block_size=self.block_size,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            dtype=parse_dtype(self.dtype),
        )

    def make_workload(self) -> Workload:
        """A fresh workload of the chosen kind and sizes.

        Raises:
            InvalidInputError: a size is out of range.
        """
        if self.workload == "multi-round-chat":
            return MultiRoundChat(
                seed=self.seed,
                users=self.users,
                system_prompt_tokens=self.system_prompt_tokens,
                turn_tokens=self.turn_tokens,
                max_context_tokens=self.max_context_tokens,
                vocab_size=self.vocab_size,
            )
        if self.workload == "long-doc-qa":
            return LongDocQA(
                seed=self.seed,
                documents=self.documents,
                questions=self.questions,
                document_tokens=self.document_tokens,
                question_tokens=self.question_tokens,
                vocab_size=self.vocab_size,
            )
        return RandomPrompts(
            seed=self.seed,
            min_tokens=self.min_prompt_tokens,
            max_tokens=self.max_prompt_tokens,
            vocab_size=self.vocab_size,
        )


class _Client(Protocol):
    """The calls a request makes: common to CacheEngine and RemoteCacheEngine."""

    async def store(
        self,
        tokens: Tokens | None = None,
        *,
        kv_caches: Sequence[torch.Tensor],
        slot_mapping: torch.Tensor,
        mask: torch.Tensor | None = None,
        req_id: str | None = None,
    ) -> int: ...

    async def retrieve(
        self,
        tokens: Tokens | None = None,
        *,
        kv_caches: Sequence[torch.Tensor],
        slot_mapping: torch.Tensor,
        mask: torch.Tensor | None = None,
        req_id: str | None = None,
        lookup_id: Hashable | None = None,
    ) -> torch.Tensor: ...

    async def lookup(
        self, tokens: Tokens | None = None, *, lookup_id: Hashable | None = None, pin: bool = False
    ) -> int: ...

    async def lookup_unpin(self, lookup_id: Hashable) -> None: ...


@dataclass(slots=True)
class _Target:
    """An open cache to drive, its chunk size and how to read its state at the end."""

    client: _Client
    chunk_size: int
    stats: Callable[[], Awaitable[dict[str, Any]]]
    """The target's counters as plain data."""
    finish: Callable[[], Awaitable[dict[str, Any]]]
    """What the target reports after the run (the embedded cache is cleared)."""


@contextlib.asynccontextmanager
async def _open_target(
    options: LoadOptions, config: EngineConfig, layout: KVLayout
) -> AsyncIterator[_Target]:
    if options.target == "embedded":
        async with CacheEngine.open(config, layout, model_name=options.model_name) as engine:

            async def engine_stats() -> dict[str, Any]:
                data: dict[str, Any] = plain_data(engine.stats())
                return data

            async def clear() -> dict[str, Any]:
                removed = await engine.clear()
                return {
                    "cleared_chunks": removed,
                    "pool_used_bytes_after_clear": engine.stats().pool.used_bytes,
                }

            yield _Target(engine, config.chunk_size, engine_stats, clear)
        return
    url = str(options.url)
    async with RemoteCacheEngine.connect(
        url, layout, model_name=options.model_name, timeout=_SIDECAR_TIMEOUT
    ) as remote:
        chunk_size = remote.chunk_size
        if chunk_size is None:  # connect() has said hello, so this is a broken server
            raise InvalidInputError(f"the sidecar at {url} did not say its chunk size")

        async def remote_stats() -> dict[str, Any]:
            snapshot = await remote.stats()
            data: dict[str, Any] = dict(snapshot.get("engine") or {})
            data["client"] = snapshot.get("client")
            data["server"] = snapshot.get("server")
            return data

        async def nothing() -> dict[str, Any]:
            return {}

        yield _Target(remote, chunk_size, remote_stats, nothing)


@dataclass(slots=True)
class _Tally:
    """Everything the run counts; mutated only from the event loop.

    A vLLM run (``operations`` :data:`VLLM_OPERATIONS`) counts the tokens the connector
    loaded as ``lookup_hit_tokens`` too (the connector's hit rate is loaded over prompt
    tokens) and the tokens it offered vLLM as ``external_tokens``.
    """

    operations: tuple[str, ...] = OPERATIONS
    requests: int = 0
    lookups: int = 0
    prompt_tokens: int = 0
    lookup_hit_tokens: int = 0
    retrieves: int = 0
    tokens_loaded: int = 0
    retrieve_short: int = 0
    stores: int = 0
    tokens_stored: int = 0
    store_requested_tokens: int = 0
    partial_stores: int = 0
    verified: int = 0
    verify_failures: int = 0
    external_tokens: int = 0
    load_failed_tokens: int = 0
    output_tokens: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    latency: dict[str, list[float]] = field(init=False)
    samples: dict[str, list[float]] = field(init=False)
    """One entry per finished request, columnar: its start (seconds into the run), token
    counts and each step's latency (nan when the step did not run)."""

    def __post_init__(self) -> None:
        self.latency = {op: [] for op in self.operations}
        columns = ("t", "prompt_tokens", "hit_tokens", "loaded_tokens", "failed")
        self.samples = {name: [] for name in (*columns, *(f"{op}_ms" for op in self.operations))}

    def progress_text(self) -> str:
        rate = self.lookup_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        errors = sum(self.errors.values()) + self.verify_failures
        return f"requests={self.requests} hit={rate:.1%} errors={errors}"


class _Runner:
    """The paged KV memory and the steps of one request."""

    def __init__(
        self,
        options: LoadOptions,
        layout: KVLayout,
        target: _Target,
        *,
        slots: int,
        max_prompt_tokens: int,
        tally: _Tally,
    ) -> None:
        self.options = options
        self.layout = layout
        self.client = target.client
        self.chunk_size = target.chunk_size
        self.tally = tally
        self._rng = torch.Generator().manual_seed(options.seed)
        self._kv_source = KVSource(layout, options.seed)
        self.blocks_per_slot = math.ceil(max_prompt_tokens / options.block_size)
        self.kv_caches = layout.allocate_kv_caches(slots * self.blocks_per_slot, random=False)
        self.start = 0.0

    def slot_mapping(self, slot: int, num_tokens: int) -> torch.Tensor:
        """Slots for ``num_tokens`` tokens in a fresh block permutation of ``slot``'s range.

        Returns an int64 tensor ``[num_tokens]``, slot = block * block_size + offset.
        """
        bs = self.options.block_size
        blocks = torch.randperm(self.blocks_per_slot, generator=self._rng, dtype=torch.int64)
        blocks += slot * self.blocks_per_slot
        pos = torch.arange(num_tokens, dtype=torch.int64)
        return blocks[pos // bs] * bs + pos % bs

    def _compute(self, prompt: Prompt, slots: torch.Tensor, start: int, end: int) -> None:
        """The prefill: write the KV of prompt tokens ``[start, end)`` into their slots."""
        positions = torch.arange(start, end, dtype=torch.int64)
        payload = self._kv_source.payload(prompt.segments, positions)
        self.layout.scatter(payload, self.kv_caches, slots[start:end])

    def _verify(self, prompt: Prompt, slots: torch.Tensor, loaded: int) -> bool:
        """Whether the KV now at a sample of ``slots[:loaded]`` is exactly the prefix's KV.

        The sample is the first and last token of every chunk (a misplaced or swapped chunk
        shows there) plus ``VERIFY_SAMPLE`` random tokens, so a check stays cheap next to
        the retrieve it checks.
        """
        chunk = self.chunk_size
        firsts = torch.arange(0, loaded, chunk, dtype=torch.int64)
        lasts = torch.clamp(firsts + chunk - 1, max=loaded - 1)
        sample = torch.randint(0, loaded, (min(VERIFY_SAMPLE, loaded),), dtype=torch.int64)
        positions = torch.unique(torch.cat([firsts, lasts, sample]))
        got = torch.empty(self.layout.payload_shape(positions.numel()), dtype=self.layout.dtype)
        self.layout.gather(self.kv_caches, slots[positions], got)
        return same_bytes(got, self._kv_source.payload(prompt.segments, positions))

    async def request(self, slot: int, prompt: Prompt, arrived: float) -> None:
        """Run one request in ``slot``'s blocks; failures are counted, never raised."""
        tally = self.tally
        client = self.client
        tokens = prompt.tokens
        num_tokens = prompt.num_tokens
        slots = self.slot_mapping(slot, num_tokens)
        tally.requests += 1
        lookup_id = f"{prompt.name}#{tally.requests}"
        timing = dict.fromkeys(OPERATIONS, math.nan)
        began = time.perf_counter()  # the clock of ``arrived`` and of the run's start
        hit = loaded = 0
        failed = False

        op = "lookup"
        tally.prompt_tokens += num_tokens  # a lookup that fails is a miss
        try:
            hit = await client.lookup(tokens, lookup_id=lookup_id, pin=True)
            timing["lookup"] = time.perf_counter() - began
            tally.lookups += 1
            tally.lookup_hit_tokens += hit

            if hit > 0:
                op = "retrieve"
                t0 = time.perf_counter()
                mask = await client.retrieve(
                    tokens,
                    kv_caches=self.kv_caches,
                    slot_mapping=slots,
                    req_id=lookup_id,
                    lookup_id=lookup_id,
                )
                timing["retrieve"] = time.perf_counter() - t0
                tally.retrieves += 1
                loaded = int(mask.sum())
                if not bool(mask[:loaded].all()):
                    tally.errors["retrieve:mask_not_a_prefix"] += 1
                    failed = True
                    return
                tally.tokens_loaded += loaded
                if loaded < hit:
                    tally.retrieve_short += 1
                every = self.options.verify_every
                if loaded > 0 and every > 0 and tally.retrieves % every == 1 % every:
                    ok = await anyio.to_thread.run_sync(self._verify, prompt, slots, loaded)
                    if ok:
                        tally.verified += 1
                    else:
                        tally.verify_failures += 1
                        failed = True
                        log.error("bench_retrieve_mismatch", req_id=lookup_id, tokens=loaded)
            else:
                op = "lookup_unpin"
                await client.lookup_unpin(lookup_id)

            op = "compute"
            t0 = time.perf_counter()
            await anyio.to_thread.run_sync(self._compute, prompt, slots, loaded, num_tokens)
            timing["compute"] = time.perf_counter() - t0

            op = "store"
            mask_start = (loaded // self.chunk_size) * self.chunk_size
            store_mask = None
            if mask_start > 0:
                store_mask = torch.zeros(num_tokens, dtype=torch.bool)
                store_mask[mask_start:] = True
            t0 = time.perf_counter()
            stored = await client.store(
                tokens,
                kv_caches=self.kv_caches,
                slot_mapping=slots,
                mask=store_mask,
                req_id=lookup_id,
            )
            timing["store"] = time.perf_counter() - t0
            tally.stores += 1
            tally.tokens_stored += stored
            tally.store_requested_tokens += num_tokens - mask_start
            if stored < num_tokens - mask_start:
                tally.partial_stores += 1
            timing["request"] = time.perf_counter() - arrived
        except Exception as exc:
            failed = True
            tally.errors[f"{op}:{type(exc).__name__}"] += 1
            log.warning("bench_request_failed", req_id=lookup_id, op=op, error=repr(exc))
        finally:
            for op_name, seconds in timing.items():
                if not math.isnan(seconds):
                    tally.latency[op_name].append(seconds)
            samples = tally.samples
            samples["t"].append(began - self.start)
            samples["prompt_tokens"].append(num_tokens)
            samples["hit_tokens"].append(hit)
            samples["loaded_tokens"].append(loaded)
            samples["failed"].append(float(failed))
            for op_name, seconds in timing.items():
                samples[f"{op_name}_ms"].append(seconds * 1e3)


class _VllmRunner:
    """The steps of one request against vLLM: submit the prompt, time its first token."""

    def __init__(self, target: VllmTarget, tally: _Tally) -> None:
        self.target = target
        self.tally = tally
        self.start = 0.0

    async def request(self, slot: int, prompt: Prompt, arrived: float) -> None:
        """Run one request; failures are counted, never raised. Its times count from
        ``arrived`` (a request that waited for a free slot waited for its first token)."""
        tally = self.tally
        tally.requests += 1
        tally.prompt_tokens += prompt.num_tokens
        request_id = f"{prompt.name}#{tally.requests}"
        timing = dict.fromkeys(VLLM_OPERATIONS, math.nan)
        began = time.perf_counter()
        loaded = 0
        failed = False
        try:
            result = await self.target.generate(request_id, prompt.tokens.tolist())
            waited = began - arrived
            timing["ttft"] = waited + result.ttft
            timing["request"] = waited + result.total
            tally.output_tokens += result.output_tokens
            counts = result.counts
            if counts is not None:
                loaded = counts.get("loaded_tokens", 0)
                tally.lookup_hit_tokens += loaded
                tally.tokens_loaded += loaded
                tally.retrieves += loaded > 0
                tally.external_tokens += counts.get("external_tokens", 0)
                tally.load_failed_tokens += counts.get("failed_tokens", 0)
                tally.tokens_stored += counts.get("stored_tokens", 0)
            elif self.target.settings.connector:
                tally.errors["connector:no_counts"] += 1
        except Exception as exc:
            failed = True
            tally.errors[f"vllm:{type(exc).__name__}"] += 1
            log.warning("bench_request_failed", req_id=request_id, op="vllm", error=repr(exc))
        finally:
            for op_name, seconds in timing.items():
                if not math.isnan(seconds):
                    tally.latency[op_name].append(seconds)
            samples = tally.samples
            samples["t"].append(began - self.start)
            samples["prompt_tokens"].append(prompt.num_tokens)
            samples["hit_tokens"].append(loaded)
            samples["loaded_tokens"].append(loaded)
            samples["failed"].append(float(failed))
            for op_name, seconds in timing.items():
                samples[f"{op_name}_ms"].append(seconds * 1e3)


class _Requester(Protocol):
    """What :func:`_drive` needs of a runner."""

    start: float

    async def request(self, slot: int, prompt: Prompt, arrived: float) -> None: ...


async def _drive(
    options: LoadOptions,
    workload: Workload,
    runner: _Requester,
    in_flight: int,
    deadline: float,
) -> None:
    """Start requests until ``deadline``, then wait for those in flight."""
    sessions = workload.sessions if workload.sessions is not None else in_flight
    send_sessions, free_sessions = anyio.create_memory_object_stream[int](sessions)
    send_slots, free_slots = anyio.create_memory_object_stream[int](in_flight)
    for session in range(sessions):
        send_sessions.send_nowait(session)
    for slot in range(in_flight):
        send_slots.send_nowait(slot)

    async def one(slot: int, session: int, prompt: Prompt, arrived: float) -> None:
        try:
            await runner.request(slot, prompt, arrived)
        finally:
            send_sessions.send_nowait(session)
            send_slots.send_nowait(slot)

    clock = time.perf_counter
    with send_sessions, free_sessions, send_slots, free_slots:
        async with anyio.create_task_group() as tg:
            if options.rate == 0:
                # Closed loop: each worker keeps one slot busy, taking the next free session.
                async def worker(slot: int) -> None:
                    while clock() < deadline:
                        session = await free_sessions.receive()
                        try:
                            if clock() < deadline:
                                prompt = workload.next_prompt(session)
                                await runner.request(slot, prompt, clock())
                        finally:
                            send_sessions.send_nowait(session)

                for slot in range(in_flight):
                    tg.start_soon(worker, slot)
                return
            gaps = random.Random(options.seed)
            arrival = clock()
            while True:
                gap = 1.0 / options.rate
                if options.arrival == "poisson":
                    gap = gaps.expovariate(options.rate)
                arrival += gap
                if arrival >= deadline:
                    break
                await anyio.sleep(max(0.0, arrival - clock()))
                slot = await free_slots.receive()
                session = await free_sessions.receive()
                tg.start_soon(one, slot, session, workload.next_prompt(session), arrival)


async def _timed_run(
    options: LoadOptions,
    workload: Workload,
    runner: _Requester,
    in_flight: int,
    *,
    tally: _Tally,
    stream: TextIO,
) -> float:
    """Drive the workload for ``options.duration`` with progress; returns the wall time."""
    clock = time.perf_counter
    start = runner.start = clock()
    deadline = start + options.duration
    progress = Progress(options.duration, stream) if options.progress else None
    try:
        with anyio.fail_after(options.duration + _GRACE_SECONDS):
            async with anyio.create_task_group() as outer:
                if progress is not None:

                    async def show() -> None:
                        while True:
                            progress.update(clock() - start, tally.progress_text())
                            await anyio.sleep(1.0)

                    outer.start_soon(show)
                await _drive(options, workload, runner, in_flight, deadline)
                outer.cancel_scope.cancel()
    except TimeoutError:
        tally.errors["run:timeout"] += 1
        log.error("bench_run_timed_out", seconds=options.duration + _GRACE_SECONDS)
    finally:
        if progress is not None:
            progress.close()
    return clock() - start


def _in_flight(options: LoadOptions, workload: Workload) -> int:
    sessions = workload.sessions if workload.sessions is not None else options.concurrency
    return min(options.concurrency, sessions)


async def run_load_async(
    options: LoadOptions,
    config: EngineConfig,
    *,
    progress_stream: TextIO | None = None,
) -> dict[str, Any]:
    """Run the workload against the target and return every figure as plain data.

    Args:
        options: the workload, target and model shape.
        config: the embedded engine's configuration (its ``chunk_size`` cuts the chunks);
            a sidecar has its own. With target ``vllm``, the connector's configuration.
        progress_stream: where progress goes when ``options.progress``; stderr when None.

    Raises:
        InvalidInputError: the options are invalid, or the sidecar serves another
            namespace; with target ``vllm``, the workload's prompts do not fit the model.
        ConfigError: the engine refuses the configuration.
        TierUnavailableError: the sidecar does not answer.
    """
    options.validate()
    stream = sys.stderr if progress_stream is None else progress_stream
    if options.target == "vllm":
        return await _run_vllm(options, config, stream)
    workload = options.make_workload()
    layout = options.layout()
    tally = _Tally()
    async with _open_target(options, config, layout) as target:
        in_flight = _in_flight(options, workload)
        runner = _Runner(
            options,
            layout,
            target,
            slots=in_flight,
            max_prompt_tokens=workload.max_prompt_tokens,
            tally=tally,
        )
        wall = await _timed_run(options, workload, runner, in_flight, tally=tally, stream=stream)
        stats = await target.stats()
        # A failed or timed-out request is a miss to the caller; count them here.
        for name in ("failed_requests", "timed_out_requests"):
            if stats.get(name):
                tally.errors[f"engine:{name}"] += int(stats[name])
        client = stats.get("client") or {}
        for name in ("timeouts", "unavailable"):
            if client.get(name):
                tally.errors[f"sidecar:{name}"] += int(client[name])
        finish = await target.finish()
        chunk_size = target.chunk_size
    return _results(
        options,
        config,
        workload,
        layout=layout,
        tally=tally,
        wall=wall,
        stats=stats,
        finish=finish,
        chunk_size=chunk_size,
        in_flight=in_flight,
    )


async def _run_vllm(options: LoadOptions, config: EngineConfig, stream: TextIO) -> dict[str, Any]:
    """The workload against vLLM (see :func:`run_load_async`)."""
    model = read_model(options.model)
    # Prompt tokens must be token ids of the model.
    options = dataclasses.replace(options, vocab_size=min(options.vocab_size, model.vocab_size))
    settings = options.vllm_settings()
    workload = options.make_workload()
    max_model_len = workload.max_prompt_tokens + options.max_tokens
    if model.max_positions is not None and max_model_len > model.max_positions:
        raise InvalidInputError(
            f"prompts of up to {workload.max_prompt_tokens} tokens plus {options.max_tokens} "
            f"generated exceed the model's max_position_embeddings ({model.max_positions}): "
            "lower the workload's prompt lengths"
        )
    tally = _Tally(operations=VLLM_OPERATIONS)
    sidecar_url = options.url if options.connector else None
    async with open_vllm(
        settings, config, max_model_len=max_model_len, sidecar_url=sidecar_url
    ) as target:
        in_flight = _in_flight(options, workload)
        runner = _VllmRunner(target, tally)
        wall = await _timed_run(options, workload, runner, in_flight, tally=tally, stream=stream)
        try:
            stats = await target.stats()
        except Exception as exc:  # the statistics are a report, not the measurement
            log.warning("bench_vllm_stats_failed", error=repr(exc))
            stats = {}
        run = {
            "model": model.path,
            "vocab_size": model.vocab_size,
            "max_model_len": max_model_len,
            "startup_seconds": target.startup_seconds,
            "warmup_seconds": target.warmup_seconds,
            "connector": (
                "none" if not options.connector else "sidecar" if sidecar_url else "embedded"
            ),
        }
        chunk_size = target.chunk_size
    return _vllm_results(
        options,
        config,
        workload,
        tally=tally,
        wall=wall,
        stats=stats,
        run=run,
        chunk_size=chunk_size,
        in_flight=in_flight,
    )


def _latency_ms(tally: _Tally) -> dict[str, dict[str, float]]:
    """Each timed step's percentiles, in milliseconds (``count`` as it is)."""
    return {
        op: {k: v * 1e3 if k != "count" else v for k, v in percentiles(vals).items()}
        for op, vals in tally.latency.items()
    }


def _per_second(amount: float, seconds: float) -> float:
    return amount / seconds if seconds > 0 else math.nan


def _vllm_results(
    options: LoadOptions,
    config: EngineConfig,
    workload: Workload,
    *,
    tally: _Tally,
    wall: float,
    stats: dict[str, Any],
    run: dict[str, Any],
    chunk_size: int | None,
    in_flight: int,
) -> dict[str, Any]:
    embedded = run["connector"] == "embedded"
    return {
        "workload": workload.name,
        "workload_description": workload.describe(),
        "target": options.target,
        "options": plain_data(options),
        "engine_config": config.to_dict() if embedded else None,
        "vllm": run,
        "chunk_size": chunk_size,
        "in_flight": in_flight,
        "wall_seconds": wall,
        "requests": tally.requests,
        "requests_per_second": _per_second(tally.requests, wall),
        "conversations": getattr(workload, "conversations", None),
        "prompt_tokens": tally.prompt_tokens,
        "output_tokens": tally.output_tokens,
        "external_tokens": tally.external_tokens,
        "tokens_loaded": tally.tokens_loaded,
        "load_failed_tokens": tally.load_failed_tokens,
        "requests_loading": tally.retrieves,
        "hit_rate": (
            tally.tokens_loaded / tally.prompt_tokens if tally.prompt_tokens else math.nan
        ),
        "tokens_per_second_loaded": _per_second(tally.tokens_loaded, wall),
        "tokens_stored": tally.tokens_stored,
        "tokens_per_second_stored": _per_second(tally.tokens_stored, wall),
        "latency_ms": _latency_ms(tally),
        "errors": dict(tally.errors),
        "errors_total": sum(tally.errors.values()),
        "verify_failures": 0,
        "engine_stats": stats,
        "samples": tally.samples,
    }


def _results(
    options: LoadOptions,
    config: EngineConfig,
    workload: Workload,
    *,
    layout: KVLayout,
    tally: _Tally,
    wall: float,
    stats: dict[str, Any],
    finish: dict[str, Any],
    chunk_size: int,
    in_flight: int,
) -> dict[str, Any]:
    token_bytes = layout.token_bytes
    latency = _latency_ms(tally)
    bytes_stored = tally.tokens_stored * token_bytes
    bytes_loaded = tally.tokens_loaded * token_bytes
    store_time = sum(tally.latency["store"])
    retrieve_time = sum(tally.latency["retrieve"])
    per_second = _per_second
    results: dict[str, Any] = {
        "workload": workload.name,
        "workload_description": workload.describe(),
        "target": options.target,
        "options": plain_data(options),
        "engine_config": config.to_dict() if options.target == "embedded" else None,
        "chunk_size": chunk_size,
        "in_flight": in_flight,
        "token_bytes": token_bytes,
        "wall_seconds": wall,
        "requests": tally.requests,
        "requests_per_second": per_second(tally.requests, wall),
        "conversations": getattr(workload, "conversations", None),
        "lookups": tally.lookups,
        "prompt_tokens": tally.prompt_tokens,
        "lookup_hit_tokens": tally.lookup_hit_tokens,
        "hit_rate": (
            tally.lookup_hit_tokens / tally.prompt_tokens if tally.prompt_tokens else math.nan
        ),
        "retrieves": tally.retrieves,
        "retrieve_short": tally.retrieve_short,
        "tokens_loaded": tally.tokens_loaded,
        "tokens_per_second_loaded": per_second(tally.tokens_loaded, wall),
        "bytes_loaded": bytes_loaded,
        "gb_loaded": bytes_loaded / 1e9,
        "gbps_loaded_op": per_second(bytes_loaded, retrieve_time) / 1e9,
        "gbps_loaded_wall": per_second(bytes_loaded, wall) / 1e9,
        "stores": tally.stores,
        "store_requested_tokens": tally.store_requested_tokens,
        "tokens_stored": tally.tokens_stored,
        "tokens_per_second_stored": per_second(tally.tokens_stored, wall),
        "bytes_stored": bytes_stored,
        "gb_stored": bytes_stored / 1e9,
        "gbps_stored_op": per_second(bytes_stored, store_time) / 1e9,
        "gbps_stored_wall": per_second(bytes_stored, wall) / 1e9,
        "partial_stores": tally.partial_stores,
        "latency_ms": latency,
        "errors": dict(tally.errors),
        "errors_total": sum(tally.errors.values()),
        "verify_sample": VERIFY_SAMPLE,
        "verified_retrieves": tally.verified,
        "verify_failures": tally.verify_failures,
        "engine_stats": stats,
        "samples": tally.samples,
    }
    results.update(finish)
    return results


def run_load(
    options: LoadOptions, config: EngineConfig, *, progress_stream: TextIO | None = None
) -> dict[str, Any]:
    """Blocking wrapper of :func:`run_load_async` (runs its own event loop).

    Raises:
        InvalidInputError: the options are invalid, or the sidecar serves another
            namespace.
        ConfigError: the engine refuses the configuration.
        TierUnavailableError: the sidecar does not answer.
    """

    async def main() -> dict[str, Any]:
        return await run_load_async(options, config, progress_stream=progress_stream)

    return anyio.run(main)


def _fmt(value: float | None, spec: str) -> str:
    """``value`` formatted, or ``-`` when it is missing (None after JSON) or not finite."""
    if value is None or not math.isfinite(value):
        return "-"
    return format(value, spec)


def format_summary(results: Mapping[str, Any]) -> str:
    """The human-readable summary of :func:`run_load` results (also of results read back
    from their JSON file)."""
    if results["target"] == "vllm":
        return _format_vllm_summary(results)
    opts = results["options"]
    kib = results["token_bytes"] / 1024
    load = _load_line(results)
    target = results["target"]
    if target == "sidecar":
        target = f"sidecar {opts['url']}"
    ran = (
        f"ran {results['wall_seconds']:.1f} s: {results['requests']} requests "
        f"({_fmt(results['requests_per_second'], '.1f')} req/s)"
    )
    if results.get("conversations") is not None:
        ran += f", {results['conversations']} conversations"
    hit_rate = results["hit_rate"]
    lines = [
        f"lmcache-async bench: {results['workload']} against {target}",
        f"model: {opts['num_layers']} layers x {opts['num_kv_heads']} kv heads x "
        f"{opts['head_size']} ({opts['dtype']}), {kib:.1f} KiB KV per token, "
        f"chunk {results['chunk_size']}",
        f"workload: {results['workload_description']}",
        f"load: {load}",
        ran,
        "",
        f"hit rate: {_fmt(None if hit_rate is None else hit_rate * 100, '.1f')} % "
        f"({results['lookup_hit_tokens']} of {results['prompt_tokens']} prompt tokens)",
        "",
    ]
    transfer = [
        [
            kind,
            str(results[f"tokens_{kind}"]),
            _fmt(results[f"tokens_per_second_{kind}"], ".0f"),
            _fmt(results[f"gb_{kind}"], ".3f"),
            _fmt(results[f"gbps_{kind}_op"], ".2f"),
            _fmt(results[f"gbps_{kind}_wall"], ".2f"),
        ]
        for kind in ("stored", "loaded")
    ]
    header = ["KV", "tokens", "tokens/s", "GB", "GB/s (in op)", "GB/s (wall)"]
    lines += [format_table(header, transfer), ""]
    lines.append(_latency_table(results, {"compute": "compute (prefill)"}))
    lines.append("")
    stats = results["engine_stats"]
    lines.append(
        f"partial stores: {results['partial_stores']}, short retrieves: "
        f"{results['retrieve_short']}, evicted chunks: {stats.get('evicted_chunks', '-')}, "
        f"cached chunks at end: {stats.get('cached_chunks', '-')}"
    )
    lines.append(_errors_line(results))
    verified = (
        f"verified {results['verified_retrieves']} retrieves bit-exact (each on the first and "
        f"last token of every chunk and {results['verify_sample']} random tokens)"
    )
    if results["verify_failures"]:
        verified += f", {results['verify_failures']} MISMATCHED"
    lines.append(verified)
    return "\n".join(lines)


def _load_line(results: Mapping[str, Any]) -> str:
    opts = results["options"]
    if opts["rate"]:
        return (
            f"{opts['rate']:g} requests/s ({opts['arrival']}), "
            f"at most {results['in_flight']} in flight"
        )
    return f"closed loop, {results['in_flight']} in flight"


def _latency_table(results: Mapping[str, Any], names: Mapping[str, str]) -> str:
    rows = []
    for op, stat in results["latency_ms"].items():
        rows.append(
            [
                names.get(op, op),
                str(int(stat["count"])),
                *(_fmt(stat[k], ".2f") for k in ("p50", "p90", "p99", "mean")),
            ]
        )
    return format_table(["latency", "count", "p50 ms", "p90 ms", "p99 ms", "mean ms"], rows)


def _errors_line(results: Mapping[str, Any]) -> str:
    errors = results["errors"]
    if not errors:
        return "errors: 0"
    detail = ", ".join(f"{k}={v}" for k, v in sorted(errors.items()))
    return f"errors: {results['errors_total']} ({detail})"


def _format_vllm_summary(results: Mapping[str, Any]) -> str:
    """The summary of a run against vLLM: time to first token and the connector's counts."""
    opts = results["options"]
    run = results["vllm"]
    connector = run["connector"]
    if connector == "sidecar":
        connector = f"sidecar {opts['url']}"
    chunk = results["chunk_size"]
    ran = (
        f"ran {results['wall_seconds']:.1f} s: {results['requests']} requests "
        f"({_fmt(results['requests_per_second'], '.1f')} req/s)"
    )
    if results.get("conversations") is not None:
        ran += f", {results['conversations']} conversations"
    hit_rate = results["hit_rate"]
    warmup = run["warmup_seconds"]
    lines = [
        f"lmcache-async bench: {results['workload']} against vllm (connector: {connector})",
        f"model: {run['model']}, max_model_len {run['max_model_len']}, "
        f"{opts['max_tokens']} output token(s) per request"
        + (f", chunk {chunk}" if chunk is not None else ""),
        f"vllm: started in {run['startup_seconds']:.1f} s"
        + (f", warm-up request {warmup:.2f} s" if warmup is not None else ""),
        f"workload: {results['workload_description']}",
        f"load: {_load_line(results)}",
        ran,
        "",
        f"hit rate: {_fmt(None if hit_rate is None else hit_rate * 100, '.1f')} % "
        f"({results['tokens_loaded']} of {results['prompt_tokens']} prompt tokens loaded by "
        f"the connector, in {results['requests_loading']} requests; "
        f"{results['external_tokens']} offered, {results['load_failed_tokens']} failed)",
        f"stored: {results['tokens_stored']} tokens "
        f"({_fmt(results['tokens_per_second_stored'], '.0f')} tokens/s), loaded: "
        f"{_fmt(results['tokens_per_second_loaded'], '.0f')} tokens/s",
        "",
        _latency_table(results, {"ttft": "time to first token", "request": "request"}),
        "",
        _errors_line(results),
    ]
    return "\n".join(lines)


def _points(
    times: Sequence[float], values: Sequence[float | None]
) -> tuple[list[float], list[float]]:
    """The (time, value) pairs whose value is present and positive (a log axis)."""
    xs: list[float] = []
    ys: list[float] = []
    for t, v in zip(times, values, strict=True):
        if v is not None and math.isfinite(v) and v > 0:
            xs.append(t)
            ys.append(v)
    return xs, ys


def check_plotting() -> None:
    """Fail early, before a run, when :func:`write_plot` could not draw.

    Raises:
        InvalidInputError: matplotlib is not installed (the ``bench`` extra).
    """
    if importlib.util.find_spec("matplotlib") is None:
        raise InvalidInputError("--plot needs matplotlib: pip install 'lmcache-async[bench]'")


def write_plot(results: Mapping[str, Any], path: str | os.PathLike[str]) -> None:
    """Draw latency and hit rate over the run as a PNG at ``path``.

    Top: every request's latency of each step (log scale). Bottom: the hit rate (prefix
    hit tokens over prompt tokens; against vLLM, the tokens the connector loaded) of the
    requests started in each time bin, and the running hit rate. Works on :func:`run_load`
    results and on their JSON read back.

    Raises:
        InvalidInputError: matplotlib is not installed (the ``bench`` extra).
        OSError: the file cannot be written.
    """
    check_plotting()
    from matplotlib.figure import Figure  # noqa: PLC0415  (optional, and slow to import)

    samples = results["samples"]
    times: list[float] = [float(t) for t in samples["t"]]
    fig = Figure(figsize=(9.0, 6.5), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True)
    operations = list(results["latency_ms"])
    for op in operations:
        xs, ys = _points(times, samples[f"{op}_ms"])
        if xs:
            top.scatter(xs, ys, s=9, alpha=0.6, label=op, marker="o" if op != "request" else "x")
    top.set_yscale("log")
    top.set_ylabel("latency (ms)")
    top.grid(True, which="both", alpha=0.3)
    if times:
        top.legend(loc="upper left", fontsize="small", ncols=len(operations))

    duration = max([results["wall_seconds"], *times, 1e-3])
    width = max(duration / 40.0, 0.25)
    bins = int(duration // width) + 1
    hits = [0.0] * bins
    prompts = [0.0] * bins
    for t, hit, prompt in zip(times, samples["hit_tokens"], samples["prompt_tokens"], strict=True):
        index = min(int(t // width), bins - 1)
        hits[index] += hit or 0
        prompts[index] += prompt or 0
    centres = [(i + 0.5) * width for i in range(bins) if prompts[i] > 0]
    rates = [100.0 * hits[i] / prompts[i] for i in range(bins) if prompts[i] > 0]
    bottom.bar(centres, rates, width=width * 0.9, alpha=0.5, label=f"per {width:.2g} s")
    # Samples are in finishing order; the running rate follows the start times.
    order = sorted(range(len(times)), key=times.__getitem__)
    running_hits = running_prompts = 0.0
    running: list[float] = []
    for i in order:
        running_hits += samples["hit_tokens"][i] or 0
        running_prompts += samples["prompt_tokens"][i] or 0
        running.append(100.0 * running_hits / running_prompts if running_prompts else 0.0)
    if times:
        ordered = [times[i] for i in order]
        bottom.plot(ordered, running, color="black", linewidth=1.2, label="since start")
        bottom.legend(loc="lower right", fontsize="small")
    bottom.set_ylim(0, 105)
    bottom.set_ylabel("hit rate (%)")
    bottom.set_xlabel("seconds since start")
    bottom.grid(True, alpha=0.3)
    fig.suptitle(
        f"lmcache-async bench: {results['workload']} against {results['target']}, "
        f"{results['requests']} requests"
    )
    fig.savefig(path, format="png", dpi=100)
