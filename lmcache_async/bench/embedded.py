"""The embedded load run: multi-round chat on an in-process engine with real KV tensors.

``N`` users share one system prompt; each turn appends new tokens to a user's history. One
turn is what a serving engine does for a request:

1. ``lookup`` the prompt (pinning the hit under a lookup id);
2. ``retrieve`` the cached prefix into the engine's paged KV memory (one tensor per layer,
   allocated once; each worker owns a block range and maps a fresh block permutation of
   it per request, like a paged allocator would);
3. "compute" the rest: write KV for the uncached tokens into their slots (the prefill);
4. ``store`` the prompt, masking the chunks that came from the cache.

Several users run at once (bounded by ``concurrency``). The KV of a token is a deterministic
function of the token's prefix, the way a model's would be: every history is a sequence of
segments (the shared system prompt, then one segment per turn), and a token's KV depends
only on its segment and its offset in it. That lets the run check retrieves bit for bit
(on a sample of each one's tokens) against what the compute step would have written.
"""

from __future__ import annotations

import itertools
import math
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, TextIO

import anyio
import structlog
import torch

from lmcache_async import CacheEngine, EngineConfig, KVLayout
from lmcache_async.bench import Progress, format_table, parse_dtype, percentiles, plain_data
from lmcache_async.errors import InvalidInputError

__all__ = [
    "EmbeddedOptions",
    "format_summary",
    "run_embedded",
    "run_embedded_async",
]

log = structlog.get_logger(__name__)

_SHIFTS: Final = 61
"""Distinct token offsets into the shared random base; varies KV between segments."""

_VERIFY_SAMPLE: Final = 256
"""Random tokens checked per verified retrieve (besides each chunk's first and last)."""

_GRACE_SECONDS: Final = 120.0
"""How long in-flight turns may run past ``duration`` before the run counts as hung."""

_OPERATIONS: Final = ("lookup", "retrieve", "compute", "store")


@dataclass(frozen=True, slots=True)
class EmbeddedOptions:
    """Shape and size of the embedded load run.

    The default model shape (16 layers, 8 KV heads of 64, bfloat16: 32 KiB of KV per token)
    is small enough for a 2-core machine and large enough that copies, not Python, dominate.
    """

    seed: int = 0
    duration: float = 8.0
    """Seconds during which new turns start; turns in flight then finish."""
    users: int = 8
    system_prompt_tokens: int = 1024
    turn_tokens: int = 384
    """New tokens per turn (the previous answer plus the next question)."""
    max_context_tokens: int = 8192
    """A conversation that would grow past this starts over from the system prompt."""
    concurrency: int = 4
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

    def validate(self) -> None:
        """Check the options as a whole.

        Raises:
            InvalidInputError: a count or size is out of range, the dtype is unknown, or
                one turn cannot fit in ``max_context_tokens``.
        """
        positive = {
            "duration": self.duration,
            "users": self.users,
            "system_prompt_tokens": self.system_prompt_tokens,
            "turn_tokens": self.turn_tokens,
            "max_context_tokens": self.max_context_tokens,
            "concurrency": self.concurrency,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_size": self.head_size,
            "block_size": self.block_size,
            "vocab_size": self.vocab_size,
        }
        for name, value in positive.items():
            if not value > 0:
                raise InvalidInputError(f"{name} must be > 0, got {value!r}")
        if self.verify_every < 0:
            raise InvalidInputError(f"verify_every must be >= 0, got {self.verify_every}")
        if self.system_prompt_tokens + self.turn_tokens > self.max_context_tokens:
            raise InvalidInputError(
                "system_prompt_tokens + turn_tokens must be <= max_context_tokens, got "
                f"{self.system_prompt_tokens} + {self.turn_tokens} > {self.max_context_tokens}"
            )
        parse_dtype(self.dtype)

    def layout(self) -> KVLayout:
        """The vLLM flash-attention layout of the benchmark model."""
        return KVLayout.vllm_flash_attn(
            num_layers=self.num_layers,
            block_size=self.block_size,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            dtype=parse_dtype(self.dtype),
        )


@dataclass(frozen=True, slots=True)
class _Segment:
    """A run of history tokens whose KV comes from one synthetic source."""

    seg_id: int
    start: int
    length: int


@dataclass(slots=True)
class _User:
    """One chat user: the current conversation's tokens and their segments."""

    uid: int
    tokens: torch.Tensor  # int64 [history]
    segments: list[_Segment]
    conversation: int = 0
    turn: int = 0


@dataclass(slots=True)
class _Tally:
    """Everything the run counts; mutated only from the event loop."""

    turns: int = 0
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
    conversations: int = 0
    verified: int = 0
    verify_failures: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    latency: dict[str, list[float]] = field(default_factory=lambda: {op: [] for op in _OPERATIONS})


def token_dim(layout: KVLayout) -> int:
    """The dimension of ``layout.payload_shape(T)`` that counts tokens.

    Raises:
        InvalidInputError: no single dimension grows with the token count.
    """
    one, two = tuple(layout.payload_shape(1)), tuple(layout.payload_shape(2))
    dims = [i for i, (a, b) in enumerate(zip(one, two, strict=True)) if a != b]
    if len(dims) != 1:
        raise InvalidInputError(f"cannot find the token dimension of payload shape {one}")
    return dims[0]


class _KVSource:
    """Deterministic synthetic KV: a token's payload depends on its segment and offset.

    A random base payload of ``payload_shape(max_segment + _SHIFTS)`` is drawn once; the
    payload of token ``a`` of segment ``s`` is the base's token ``k + a`` plus a constant,
    with ``k`` and the constant derived from ``s``. Cheap (one gather and one add per
    element), finite (no NaN bit patterns), and computed by one code path for any set of
    positions, so the same token always gets the same bits.
    """

    def __init__(self, layout: KVLayout, max_segment: int, seed: int) -> None:
        self._dim = token_dim(layout)
        gen = torch.Generator().manual_seed(seed)
        shape = tuple(layout.payload_shape(max_segment + _SHIFTS))
        self._base = torch.randn(shape, generator=gen, dtype=torch.float32).to(layout.dtype)

    def payload(self, segments: list[_Segment], positions: torch.Tensor) -> torch.Tensor:
        """Payload of the history tokens at ``positions`` (int64 ``[n]``, ascending or not).

        Returns a contiguous ``layout.payload_shape(n)`` tensor of the layout's dtype.
        """
        starts = torch.tensor([seg.start for seg in segments], dtype=torch.int64)
        shifts = torch.tensor([(seg.seg_id * 7919) % _SHIFTS for seg in segments])
        biases = torch.tensor(
            [((seg.seg_id * 2654435761) % 1021) / 128.0 for seg in segments], dtype=torch.float32
        )
        which = torch.searchsorted(starts, positions, right=True) - 1
        rows = shifts[which] + positions - starts[which]
        out = self._base.index_select(self._dim, rows)
        view = [1] * out.dim()
        view[self._dim] = int(positions.numel())
        out.add_(biases[which].view(view))
        return out


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors hold exactly the same bytes (bit-exact, -0.0 != 0.0)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


class _Workload:
    """The users, the paged KV memory and the per-turn logic of the run."""

    def __init__(
        self,
        options: EmbeddedOptions,
        layout: KVLayout,
        engine: CacheEngine,
        chunk_size: int,
        tally: _Tally,
    ) -> None:
        self.options = options
        self.layout = layout
        self.engine = engine
        self.chunk_size = chunk_size
        self.tally = tally
        self._rng = torch.Generator().manual_seed(options.seed)
        self._seg_ids: Iterator[int] = itertools.count(1)
        self._kv_source = _KVSource(
            layout, max(options.system_prompt_tokens, options.turn_tokens), options.seed
        )
        self.workers = min(options.concurrency, options.users)
        self.blocks_per_worker = math.ceil(options.max_context_tokens / options.block_size)
        self.kv_caches = layout.allocate_kv_caches(
            self.workers * self.blocks_per_worker, random=False
        )
        self._system_tokens = self._random_tokens(options.system_prompt_tokens)
        self.users = [self._new_user(uid) for uid in range(options.users)]

    def _random_tokens(self, n: int) -> torch.Tensor:
        return torch.randint(
            0, self.options.vocab_size, (n,), generator=self._rng, dtype=torch.int64
        )

    def _new_user(self, uid: int, conversation: int = 0) -> _User:
        system = _Segment(0, 0, self.options.system_prompt_tokens)
        self.tally.conversations += 1
        return _User(uid, self._system_tokens.clone(), [system], conversation=conversation)

    def _next_prompt(self, user: _User) -> _User:
        """Append one turn to ``user`` (starting over when the context is full)."""
        opts = self.options
        if user.tokens.numel() + opts.turn_tokens > opts.max_context_tokens:
            user = self._new_user(user.uid, user.conversation + 1)
            self.users[user.uid] = user
        start = user.tokens.numel()
        user.segments.append(_Segment(next(self._seg_ids), start, opts.turn_tokens))
        user.tokens = torch.cat([user.tokens, self._random_tokens(opts.turn_tokens)])
        user.turn += 1
        return user

    def slot_mapping(self, worker: int, num_tokens: int) -> torch.Tensor:
        """Slots for ``num_tokens`` tokens in a fresh block permutation of ``worker``'s range.

        Returns an int64 tensor ``[num_tokens]``, slot = block * block_size + offset.
        """
        bs = self.options.block_size
        blocks = torch.randperm(self.blocks_per_worker, generator=self._rng, dtype=torch.int64)
        blocks += worker * self.blocks_per_worker
        pos = torch.arange(num_tokens, dtype=torch.int64)
        return blocks[pos // bs] * bs + pos % bs

    def _compute(self, user: _User, slots: torch.Tensor, start: int, end: int) -> None:
        """The prefill: write KV of history tokens ``[start, end)`` into their slots."""
        positions = torch.arange(start, end, dtype=torch.int64)
        payload = self._kv_source.payload(user.segments, positions)
        self.layout.scatter(payload, self.kv_caches, slots[start:end])

    def _verify(self, user: _User, slots: torch.Tensor, loaded: int) -> bool:
        """Whether the KV now at a sample of ``slots[:loaded]`` is exactly the prefix's KV.

        The sample is the first and last token of every chunk (a misplaced or swapped chunk
        shows there) plus ``_VERIFY_SAMPLE`` random tokens, so a check stays cheap next to
        the retrieve it checks.
        """
        chunk = self.chunk_size
        firsts = torch.arange(0, loaded, chunk, dtype=torch.int64)
        lasts = torch.clamp(firsts + chunk - 1, max=loaded - 1)
        sample = torch.randint(0, loaded, (min(_VERIFY_SAMPLE, loaded),), dtype=torch.int64)
        positions = torch.unique(torch.cat([firsts, lasts, sample]))
        got = torch.empty(self.layout.payload_shape(positions.numel()), dtype=self.layout.dtype)
        self.layout.gather(self.kv_caches, slots[positions], got)
        return _same_bytes(got, self._kv_source.payload(user.segments, positions))

    async def turn(self, worker: int, uid: int) -> None:
        """Run one request of user ``uid`` on ``worker``'s KV blocks; failures are counted."""
        tally = self.tally
        user = self._next_prompt(self.users[uid])
        tokens = user.tokens
        num_tokens = tokens.numel()
        slots = self.slot_mapping(worker, num_tokens)
        lookup_id = f"u{uid}-c{user.conversation}-t{user.turn}"
        tally.turns += 1

        op = "lookup"
        try:
            t0 = time.perf_counter()
            hit = await self.engine.lookup(tokens, lookup_id=lookup_id, pin=True)
            tally.latency["lookup"].append(time.perf_counter() - t0)
            tally.lookups += 1
            tally.prompt_tokens += num_tokens
            tally.lookup_hit_tokens += hit

            loaded = 0
            if hit > 0:
                op = "retrieve"
                t0 = time.perf_counter()
                mask = await self.engine.retrieve(
                    tokens,
                    kv_caches=self.kv_caches,
                    slot_mapping=slots,
                    req_id=lookup_id,
                    lookup_id=lookup_id,
                )
                tally.latency["retrieve"].append(time.perf_counter() - t0)
                tally.retrieves += 1
                loaded = int(mask.sum())
                if not bool(mask[:loaded].all()):
                    tally.errors["retrieve:mask_not_a_prefix"] += 1
                    return
                tally.tokens_loaded += loaded
                if loaded < hit:
                    tally.retrieve_short += 1
                every = self.options.verify_every
                if loaded > 0 and every > 0 and tally.retrieves % every == 1 % every:
                    ok = await anyio.to_thread.run_sync(self._verify, user, slots, loaded)
                    if ok:
                        tally.verified += 1
                    else:
                        tally.verify_failures += 1
                        log.error("bench_retrieve_mismatch", req_id=lookup_id, tokens=loaded)
            else:
                op = "lookup_unpin"
                await self.engine.lookup_unpin(lookup_id)

            op = "compute"
            t0 = time.perf_counter()
            await anyio.to_thread.run_sync(self._compute, user, slots, loaded, num_tokens)
            tally.latency["compute"].append(time.perf_counter() - t0)

            op = "store"
            mask_start = (loaded // self.chunk_size) * self.chunk_size
            store_mask = None
            if mask_start > 0:
                store_mask = torch.zeros(num_tokens, dtype=torch.bool)
                store_mask[mask_start:] = True
            t0 = time.perf_counter()
            stored = await self.engine.store(
                tokens,
                kv_caches=self.kv_caches,
                slot_mapping=slots,
                mask=store_mask,
                req_id=lookup_id,
            )
            tally.latency["store"].append(time.perf_counter() - t0)
            tally.stores += 1
            tally.tokens_stored += stored
            tally.store_requested_tokens += num_tokens - mask_start
            if stored < num_tokens - mask_start:
                tally.partial_stores += 1
        except Exception as exc:
            tally.errors[f"{op}:{type(exc).__name__}"] += 1
            log.warning("bench_request_failed", req_id=lookup_id, op=op, error=repr(exc))


def _progress_text(tally: _Tally) -> str:
    rate = tally.lookup_hit_tokens / tally.prompt_tokens if tally.prompt_tokens else 0.0
    errors = sum(tally.errors.values()) + tally.verify_failures
    return f"requests={tally.turns} hit={rate:.1%} errors={errors}"


async def run_embedded_async(
    options: EmbeddedOptions,
    config: EngineConfig,
    *,
    progress_stream: TextIO | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, Any]:
    """Run the chat workload on a fresh engine and return every figure as plain data.

    Args:
        options: the workload and model shape.
        config: the engine configuration (its ``chunk_size`` cuts the chunks).
        progress_stream: where progress goes when ``options.progress``; stderr when None.
        clock: wall clock for the run's duration.

    Raises:
        InvalidInputError: the options are invalid.
        ConfigError: the engine refuses the configuration.
    """
    options.validate()
    layout = options.layout()
    tally = _Tally()
    stream = sys.stderr if progress_stream is None else progress_stream
    async with CacheEngine.open(config, layout, model_name="lmcache-async-bench") as engine:
        work = _Workload(options, layout, engine, config.chunk_size, tally)
        send_users, receive_users = anyio.create_memory_object_stream[int](options.users)
        for uid in range(options.users):
            send_users.send_nowait(uid)

        start = clock()
        deadline = start + options.duration

        async def worker(index: int) -> None:
            # Users >= workers, so a user is always free: receive() never waits for long.
            while clock() < deadline:
                uid = await receive_users.receive()
                try:
                    if clock() < deadline:
                        await work.turn(index, uid)
                finally:
                    send_users.send_nowait(uid)

        progress = Progress(options.duration, stream) if options.progress else None
        try:
            with anyio.fail_after(options.duration + _GRACE_SECONDS):
                async with anyio.create_task_group() as outer:
                    if progress is not None:

                        async def show() -> None:
                            while True:
                                progress.update(clock() - start, _progress_text(tally))
                                await anyio.sleep(1.0)

                        outer.start_soon(show)
                    async with anyio.create_task_group() as workers:
                        for index in range(work.workers):
                            workers.start_soon(worker, index)
                    outer.cancel_scope.cancel()
        except TimeoutError:
            tally.errors["run:timeout"] += 1
            log.error("bench_run_timed_out", seconds=options.duration + _GRACE_SECONDS)
        finally:
            if progress is not None:
                progress.close()
            send_users.close()
            receive_users.close()
        wall = clock() - start
        stats = engine.stats()
        # The engine turns a failed or timed-out request into a miss; count them here.
        if stats.failed_requests:
            tally.errors["engine:failed_requests"] += stats.failed_requests
        if stats.timed_out_requests:
            tally.errors["engine:timed_out_requests"] += stats.timed_out_requests
        removed = await engine.clear()
        pool_after_clear = engine.stats().pool.used_bytes

    token_bytes = layout.token_bytes
    latency = {
        op: {k: v * 1e3 if k not in ("count",) else v for k, v in percentiles(vals).items()}
        for op, vals in tally.latency.items()
    }
    bytes_stored = tally.tokens_stored * token_bytes
    bytes_loaded = tally.tokens_loaded * token_bytes
    store_time = sum(tally.latency["store"])
    retrieve_time = sum(tally.latency["retrieve"])
    return {
        "options": plain_data(options),
        "engine_config": config.to_dict(),
        "token_bytes": token_bytes,
        "wall_seconds": wall,
        "requests": tally.turns,
        "requests_per_second": tally.turns / wall if wall > 0 else math.nan,
        "conversations": tally.conversations,
        "lookups": tally.lookups,
        "prompt_tokens": tally.prompt_tokens,
        "lookup_hit_tokens": tally.lookup_hit_tokens,
        "hit_rate": (
            tally.lookup_hit_tokens / tally.prompt_tokens if tally.prompt_tokens else math.nan
        ),
        "retrieves": tally.retrieves,
        "retrieve_short": tally.retrieve_short,
        "tokens_loaded": tally.tokens_loaded,
        "bytes_loaded": bytes_loaded,
        "gb_loaded": bytes_loaded / 1e9,
        "gbps_loaded_op": bytes_loaded / retrieve_time / 1e9 if retrieve_time > 0 else math.nan,
        "gbps_loaded_wall": bytes_loaded / wall / 1e9 if wall > 0 else math.nan,
        "stores": tally.stores,
        "store_requested_tokens": tally.store_requested_tokens,
        "tokens_stored": tally.tokens_stored,
        "bytes_stored": bytes_stored,
        "gb_stored": bytes_stored / 1e9,
        "gbps_stored_op": bytes_stored / store_time / 1e9 if store_time > 0 else math.nan,
        "gbps_stored_wall": bytes_stored / wall / 1e9 if wall > 0 else math.nan,
        "partial_stores": tally.partial_stores,
        "latency_ms": latency,
        "errors": dict(tally.errors),
        "errors_total": sum(tally.errors.values()),
        "verified_retrieves": tally.verified,
        "verify_failures": tally.verify_failures,
        "engine_stats": plain_data(stats),
        "cleared_chunks": removed,
        "pool_used_bytes_after_clear": pool_after_clear,
    }


def run_embedded(
    options: EmbeddedOptions, config: EngineConfig, *, progress_stream: TextIO | None = None
) -> dict[str, Any]:
    """Blocking wrapper of :func:`run_embedded_async` (runs its own event loop).

    Raises:
        InvalidInputError: the options are invalid.
        ConfigError: the engine refuses the configuration.
    """

    async def main() -> dict[str, Any]:
        return await run_embedded_async(options, config, progress_stream=progress_stream)

    return anyio.run(main)


def _fmt(value: float, spec: str) -> str:
    return "-" if not math.isfinite(value) else format(value, spec)


def format_summary(results: Mapping[str, Any]) -> str:
    """The human-readable summary of :func:`run_embedded` results."""
    opts = results["options"]
    kib = results["token_bytes"] / 1024
    chunk = results["engine_config"]["chunk_size"]
    lines = [
        "lmcache-async embedded bench",
        f"model: {opts['num_layers']} layers x {opts['num_kv_heads']} kv heads x "
        f"{opts['head_size']} ({opts['dtype']}), {kib:.1f} KiB KV per token, chunk {chunk}",
        f"workload: {opts['users']} users, concurrency {opts['concurrency']}, system prompt "
        f"{opts['system_prompt_tokens']} tokens, {opts['turn_tokens']} tokens per turn, "
        f"context <= {opts['max_context_tokens']}",
        f"ran {results['wall_seconds']:.1f} s: {results['requests']} requests "
        f"({results['requests_per_second']:.1f} req/s), {results['conversations']} "
        "conversations",
        "",
        f"hit rate: {_fmt(results['hit_rate'] * 100, '.1f')} % "
        f"({results['lookup_hit_tokens']} of {results['prompt_tokens']} prompt tokens)",
        "",
    ]
    transfer = [
        [
            "stored",
            str(results["tokens_stored"]),
            _fmt(results["gb_stored"], ".3f"),
            _fmt(results["gbps_stored_op"], ".2f"),
            _fmt(results["gbps_stored_wall"], ".2f"),
        ],
        [
            "loaded",
            str(results["tokens_loaded"]),
            _fmt(results["gb_loaded"], ".3f"),
            _fmt(results["gbps_loaded_op"], ".2f"),
            _fmt(results["gbps_loaded_wall"], ".2f"),
        ],
    ]
    lines.append(format_table(["KV", "tokens", "GB", "GB/s (in op)", "GB/s (wall)"], transfer))
    lines.append("")
    rows = []
    for op in _OPERATIONS:
        stat = results["latency_ms"][op]
        name = "compute (prefill)" if op == "compute" else op
        rows.append(
            [
                name,
                str(int(stat["count"])),
                _fmt(stat["p50"], ".2f"),
                _fmt(stat["p90"], ".2f"),
                _fmt(stat["p99"], ".2f"),
                _fmt(stat["mean"], ".2f"),
            ]
        )
    lines.append(format_table(["latency", "count", "p50 ms", "p90 ms", "p99 ms", "mean ms"], rows))
    lines.append("")
    stats = results["engine_stats"]
    lines.append(
        f"partial stores: {results['partial_stores']}, short retrieves: "
        f"{results['retrieve_short']}, evicted chunks: {stats.get('evicted_chunks', '-')}, "
        f"cached chunks at end: {stats.get('cached_chunks', '-')}"
    )
    errors = results["errors"]
    if errors:
        detail = ", ".join(f"{k}={v}" for k, v in sorted(errors.items()))
        lines.append(f"errors: {results['errors_total']} ({detail})")
    else:
        lines.append("errors: 0")
    verified = (
        f"verified {results['verified_retrieves']} retrieves bit-exact (each on the first and "
        f"last token of every chunk and {_VERIFY_SAMPLE} random tokens)"
    )
    if results["verify_failures"]:
        verified += f", {results['verify_failures']} MISMATCHED"
    lines.append(verified)
    return "\n".join(lines)
