"""A whole trace replay: check the trace, replay it, sweep the capacities, compute the bounds.

1. **scan**: every line is read and checked before anything starts (a bad line is an error
   naming it, and nothing has run); the scan gives the longest prompt, which sizes the
   replay's paged KV memory and vLLM's context;
2. **replay** at the tier sizes asked for (:func:`~.targets.replay_at`), then once per
   capacity of a sweep when asked to;
3. **bounds**: one more pass over the hash ids computes the unbounded cache and a block
   LRU at the capacity the engine turned out to have (its CPU tier's, or its disk tier's
   when it has one) and at each capacity of the sweep.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

import anyio

from lmcache_async import EngineConfig, KVLayout
from lmcache_async.bench.trace.bounds import bounds_of_file, scan_trace
from lmcache_async.bench.trace.options import DEFAULT_VOCAB, TraceOptions
from lmcache_async.bench.trace.results import trace_results
from lmcache_async.bench.trace.sizing import (
    ChunkSize,
    chunk_size_of,
    cpu_chunks_held,
    disk_chunks_held,
    model_layout,
    record_bytes,
    room_of,
)
from lmcache_async.bench.trace.sweep import sweep_replays, sweep_rows
from lmcache_async.bench.trace.targets import Replayed, TierSizes, replay_at
from lmcache_async.bench.trace.tokens import BlockTokens
from lmcache_async.bench.vllm_target import read_model
from lmcache_async.errors import InvalidInputError

__all__ = ["run_trace", "run_trace_async"]


def _vocab(options: TraceOptions) -> int:
    """The vocabulary prompts are drawn from: vLLM's model's, or ``vocab_size``.

    Raises:
        InvalidInputError: ``vocab_size`` is larger than the model's.
    """
    if options.target != "vllm":
        return options.vocab_size or DEFAULT_VOCAB
    model = read_model(options.model)
    if options.vocab_size is not None and options.vocab_size > model.vocab_size:
        raise InvalidInputError(
            f"--trace-vocab {options.vocab_size} is over the model's vocabulary "
            f"({model.vocab_size}): token ids must be the model's"
        )
    return options.vocab_size or model.vocab_size


def _capacities(replayed: Replayed, chunk: ChunkSize, *, vllm: bool) -> dict[str, int | None]:
    """The chunks each tier of a replay's engine holds (None where it cannot be told)."""
    stats = replayed.stats
    room: int | None = chunk.room
    if vllm:  # the connector's chunks are the model's: their size shows in its tier
        cpu = (stats.get("tiers") or {}).get("cpu") or {}
        room = room_of(cpu.get("bytes"), cpu.get("chunks"))
    config = replayed.config
    disk_bytes = None
    if config is not None and config.local_disk is not None:
        disk_bytes = config.disk_capacity_bytes
    return {"cpu": cpu_chunks_held(stats, room), "disk": disk_chunks_held(stats, disk_bytes)}


async def run_trace_async(
    options: TraceOptions, config: EngineConfig, *, progress_stream: TextIO | None = None
) -> dict[str, Any]:
    """Replay the trace and return every figure as plain data (see the package docstring).

    ``config``: the engine's configuration (the embedded engine's, a started sidecar's or
    vLLM's connector's), given the trace's chunking and the tier sizes of ``options``.
    Progress goes to ``progress_stream`` (stderr when None) when ``options.progress``.

    Raises:
        InvalidInputError: the options are invalid, a line of the trace is bad (the
            message names it), the sidecar's chunk size is not the block size, or vLLM
            cannot take the prompts.
        ConfigError: the engine refuses the configuration.
        TierUnavailableError: the sidecar does not answer.
        OSError: the trace cannot be read.
    """
    options.validate()
    stream = (progress_stream or sys.stderr) if options.progress else None
    bs = options.block_size
    scan = await anyio.to_thread.run_sync(
        lambda: scan_trace(options.path, block_size=bs, limit=options.limit)
    )
    if stream is not None:
        print(f"bench: trace: {scan.requests} requests checked", file=stream, flush=True)
    vllm = options.target == "vllm"
    layout = (
        model_layout(str(options.model), options.vllm_dtype)
        if vllm
        else options.load_options().layout()
    )
    tokens = BlockTokens(block_size=bs, vocab_size=_vocab(options), seed=options.seed)
    chunk = chunk_size_of(layout, bs, layerwise=config.use_layerwise)
    disk = options.disk or config.local_disk is not None
    record = await record_bytes(config, layout, chunk) if disk else None
    if options.cpu_tokens is not None:
        cpu_chunks: int | None = options.cpu_tokens // bs
    elif options.disk:  # a small CPU tier: the prompts in flight and one more
        cpu_chunks = (options.concurrency + 1) * max(1, scan.max_full_blocks)
    else:
        cpu_chunks = None
    disk_chunks = None if options.disk_tokens is None else options.disk_tokens // bs
    notes: list[str] = []

    async def replay(sizes: TierSizes, label: str) -> tuple[Replayed, dict[str, int | None]]:
        done = await replay_at(
            options,
            config,
            sizes,
            scan=scan,
            tokens=tokens,
            layout=layout,
            chunk=chunk,
            label=label,
            stream=stream,
        )
        held = _capacities(done, chunk, vllm=vllm)
        notes.extend(_check_sizes(done, sizes, held, record))
        return done, held

    main: Replayed | None = None
    capacities: dict[str, int | None] = {"cpu": None, "disk": None}
    if scan.requests:
        main, capacities = await replay(TierSizes(cpu_chunks, disk_chunks, record), "trace replay")
        if main.cached_chunks_at_start:
            notes.append(
                f"the cache held {main.cached_chunks_at_start} chunks at the start: the bounds "
                "are of an empty one"
            )
    replays = None
    if options.sweep_replay and scan.requests:
        replays = await sweep_replays(
            options.capacities,
            block_size=bs,
            cpu_chunks=cpu_chunks,
            disk_record=record,
            disk=disk,
            replay=replay,
        )
    lru_tier = "disk" if capacities["disk"] is not None else "cpu"
    engine_cap = capacities[lru_tier]
    caps = [tokens_cap // bs for tokens_cap in options.capacities]
    caps += [run.held_blocks for run in replays or () if run.held_blocks is not None]
    if engine_cap is not None:
        caps.insert(0, engine_cap)
    bounds = await anyio.to_thread.run_sync(
        lambda: bounds_of_file(
            options.path,
            block_size=bs,
            limit=options.limit,
            capacities=caps,
            record=0 if engine_cap is not None else None,
        )
    )
    if engine_cap is not None and bounds.lru[0].partial_stores:
        notes.append(
            f"{bounds.lru[0].partial_stores} prompts are longer than the {lru_tier} tier "
            f"({engine_cap} chunks): their stores are partial, after a wait for memory"
        )
    by_capacity = {bound.capacity_blocks: bound for bound in bounds.lru}
    sweep = sweep_rows(options.capacities, chunk, by_capacity, disk_record=record, replays=replays)
    return trace_results(
        options,
        scan,
        bounds,
        main=main,
        capacities=capacities,
        lru_tier=lru_tier if engine_cap is not None else None,
        chunk=chunk,
        layout=_layout_data(layout),
        disk_record=record,
        sweep=sweep,
        notes=notes,
    )


def _layout_data(layout: KVLayout) -> dict[str, Any]:
    return {
        "num_layers": layout.num_layers,
        "num_kv_heads": layout.num_kv_heads,
        "head_size": layout.head_size,
        "dtype": str(layout.dtype).removeprefix("torch."),
        "token_bytes": layout.token_bytes,
    }


def _check_sizes(
    done: Replayed,
    sizes: TierSizes,
    held: dict[str, int | None],
    record: int | None,
) -> list[str]:
    """What differs between the tiers asked for and the tiers the engine had (the bounds
    are computed at what it had)."""
    notes: list[str] = []
    if done.config is None:
        return notes
    for tier, asked in (("cpu", sizes.cpu_chunks), ("disk", sizes.disk_chunks)):
        if asked is not None and held[tier] is not None and held[tier] != asked:
            why = " (a sidecar's shared memory is whole 4 KiB pages)" if done.url else ""
            notes.append(f"the {tier} tier holds {held[tier]} chunks, {asked} were asked{why}")
    disk = (done.stats.get("tiers") or {}).get("disk") or {}
    if record is not None and disk.get("chunks"):
        measured = int(disk["bytes"]) / int(disk["chunks"])
        if measured != record:
            notes.append(f"disk records are {measured:.0f} bytes, not {record} as probed")
    return notes


def run_trace(
    options: TraceOptions, config: EngineConfig, *, progress_stream: TextIO | None = None
) -> dict[str, Any]:
    """Blocking wrapper of :func:`run_trace_async` (runs its own event loop).

    Raises:
        InvalidInputError: see :func:`run_trace_async`.
        ConfigError: the engine refuses the configuration.
        TierUnavailableError: the sidecar does not answer.
        OSError: the trace cannot be read.
    """

    async def main() -> dict[str, Any]:
        return await run_trace_async(options, config, progress_stream=progress_stream)

    return anyio.run(main)
