"""The steps of one request: against a cache in KV tensors, or against vLLM.

A runner's :meth:`request` never raises: a failed step is counted in the
:class:`~lmcache_async.bench.loadgen.tally.Tally` (and logged), so one bad request does
not end the run.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Final

import anyio
import torch

from lmcache_async import KVLayout
from lmcache_async.bench.loadgen.options import OPERATIONS, VLLM_OPERATIONS, LoadOptions
from lmcache_async.bench.loadgen.tally import Tally
from lmcache_async.bench.loadgen.targets import Target
from lmcache_async.bench.vllm_target import VllmTarget
from lmcache_async.bench.workloads import KVSource, Prompt, same_bytes
from lmcache_async.logging import get_logger

__all__ = ["VERIFY_SAMPLE", "CacheRunner", "OnRequest", "VllmRunner"]

log = get_logger(__name__)

VERIFY_SAMPLE: Final = 256
"""Random tokens checked per verified retrieve (besides each chunk's first and last)."""

OnRequest = Callable[[Tally], bool | None]
"""Told of each request that ended (the tally counts it already); True: start no more
requests (those in flight finish). It must not block."""


class CacheRunner:
    """The paged KV memory and the steps of one request."""

    def __init__(
        self,
        options: LoadOptions,
        layout: KVLayout,
        target: Target,
        *,
        slots: int,
        max_prompt_tokens: int,
        tally: Tally,
        on_request: OnRequest | None = None,
    ) -> None:
        self.options = options
        self.on_request = on_request
        self.layout = layout
        self.client = target.client
        self.chunk_size = target.chunk_size
        self.tally = tally
        self._rng = torch.Generator().manual_seed(options.seed)
        self._kv_source = KVSource(layout, options.seed)
        self.blocks_per_slot = math.ceil(max_prompt_tokens / options.block_size)
        self.kv_caches = layout.allocate_kv_caches(slots * self.blocks_per_slot, random=False)
        self.start = 0.0
        self.stopping = False

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
            if self.on_request is not None and self.on_request(tally):
                self.stopping = True


class VllmRunner:
    """The steps of one request against vLLM: submit the prompt, time its first token."""

    def __init__(
        self, target: VllmTarget, tally: Tally, on_request: OnRequest | None = None
    ) -> None:
        self.target = target
        self.tally = tally
        self.on_request = on_request
        self.start = 0.0
        self.stopping = False

    async def request(
        self, slot: int, prompt: Prompt, arrived: float, *, max_tokens: int | None = None
    ) -> None:
        """Run one request; failures are counted, never raised. Its times count from
        ``arrived`` (a request that waited for a free slot waited for its first token).
        ``max_tokens``: tokens to generate (None: the target's setting)."""
        tally = self.tally
        tally.requests += 1
        tally.prompt_tokens += prompt.num_tokens
        request_id = f"{prompt.name}#{tally.requests}"
        timing = dict.fromkeys(VLLM_OPERATIONS, math.nan)
        began = time.perf_counter()
        loaded = 0
        failed = False
        try:
            tokens = prompt.tokens.tolist()
            result = await self.target.generate(request_id, tokens, max_tokens=max_tokens)
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
            if self.on_request is not None and self.on_request(tally):
                self.stopping = True
