"""A load generator for a sidecar: shared-prefix and one-off prompts at a target rate.

Each request does what a serving engine asks of the cache for one prompt, through a
:class:`~lmcache_async.RemoteCacheEngine`: a lookup (pinned), a load of the cached prefix
into the engine's paged KV memory, then a store of the whole prompt. A share (``--shared``)
of the prompts start with one of ``--prefixes`` shared prefixes (a system prompt, a
document), the rest are one-off. Requests arrive on a Poisson schedule at ``--rate`` per
second whatever the cache's speed (open loop), at most ``--max-in-flight`` at once. Each
token's KV rows are its row of a random table, so every load is checked bit for bit.
Prints the hit rate and latency percentiles (a live progress line on stderr if a terminal).
Without ``--url`` it starts ``lmcache-async serve`` itself, and stops it at the end. Exit
status 0 when every request succeeded and every load was exact::

    python examples/load_test.py [--rate 100] [--requests 500] [--url ipc:///tmp/x.sock]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import tempfile
import time
from contextlib import AsyncExitStack

import anyio
import torch

from lmcache_async import EngineConfig, KVLayout, LMCacheAsyncError, RemoteCacheEngine
from lmcache_async.bench.sidecar import sidecar_process

LAYOUT = KVLayout.vllm_flash_attn(
    num_layers=2, block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16
)
VOCAB = 32000
TABLE = torch.randn(VOCAB, 2, LAYOUT.num_kv_heads, LAYOUT.head_size).half()  # K, V per token


class Tally:
    def __init__(self) -> None:
        self.load_s: list[float] = []  # lookup + load, per request
        self.store_s: list[float] = []
        self.prompt_tokens = self.hit_tokens = self.hits = self.exact = self.failed = 0


async def request(engine: RemoteCacheEngine, tokens: torch.Tensor, rid: int, tally: Tally) -> None:
    """Look up, load the hit, store: one prompt's calls, timed and checked."""
    n, slots = tokens.numel(), torch.arange(tokens.numel())
    kv = LAYOUT.allocate_kv_caches(math.ceil(n / LAYOUT.block_size), random=False)
    by_token = [layer.view(2, -1, *TABLE.shape[2:]) for layer in kv]  # [2, slots, heads, size]
    rows = TABLE[tokens].transpose(0, 1)
    try:
        began = time.perf_counter()
        hit = await engine.lookup(tokens, lookup_id=rid, pin=True)
        if hit:
            mask = await engine.retrieve(
                tokens[:hit], kv_caches=kv, slot_mapping=slots[:hit], lookup_id=rid
            )
            hit = int(mask.cumprod(0).sum())  # the prefix loaded (a chunk may have gone)
        else:
            await engine.lookup_unpin(rid)
        loaded = time.perf_counter()
        exact = all(torch.equal(layer[:, :hit], rows[:, :hit]) for layer in by_token)
        for layer in by_token:  # the serving engine computes the rest, then stores the prompt
            layer[:, :n] = rows
        stored = time.perf_counter()
        await engine.store(tokens, kv_caches=kv, slot_mapping=slots)
    except LMCacheAsyncError:
        tally.failed += 1
        return
    tally.load_s.append(loaded - began)
    tally.store_s.append(time.perf_counter() - stored)
    tally.prompt_tokens, tally.hit_tokens = tally.prompt_tokens + n, tally.hit_tokens + hit
    if hit:
        tally.hits, tally.exact = tally.hits + 1, tally.exact + exact


def percentiles(seconds: list[float]) -> str:
    p = statistics.quantiles(seconds, n=100)
    return f"p50 {p[49] * 1e3:.2f} ms, p90 {p[89] * 1e3:.2f} ms, p99 {p[98] * 1e3:.2f} ms"


async def run(args: argparse.Namespace) -> int:
    rng, tally = random.Random(args.seed), Tally()
    torch.manual_seed(args.seed)

    def tokens(n: int) -> torch.Tensor:
        return torch.randint(0, VOCAB, (n,))

    prefixes = [tokens(args.prefix) for _ in range(args.prefixes)]
    limiter = anyio.CapacityLimiter(args.max_in_flight)
    async with AsyncExitStack() as stack:
        url = args.url
        if url is None:  # a sidecar of our own: `lmcache-async serve`, stopped at the end
            directory = stack.enter_context(tempfile.TemporaryDirectory())
            config = EngineConfig(max_local_cpu_size=0.5)
            url = await stack.enter_async_context(sidecar_process(config, directory))
        connect = RemoteCacheEngine.connect(url, LAYOUT, model_name="load-test", timeout=60)
        engine = await stack.enter_async_context(connect)
        print(f"sidecar: {url}")
        print(
            f"workload: {args.requests} requests at {args.rate:g}/s, {args.shared:.0%} on "
            f"{args.prefixes} shared {args.prefix}-token prefixes, {args.suffix} new tokens each"
        )

        async def one(rid: int, tokens: torch.Tensor) -> None:
            async with limiter:
                await request(engine, tokens, rid, tally)

        began = at = anyio.current_time()
        async with anyio.create_task_group() as group:
            for rid in range(args.requests):
                shared = rng.random() < args.shared
                prefix = rng.choice(prefixes) if shared else tokens(args.prefix)
                group.start_soon(one, rid, torch.cat([prefix, tokens(args.suffix)]))
                at += rng.expovariate(args.rate)
                await anyio.sleep_until(at)
                if sys.stderr.isatty():  # a live line, kept out of a redirected stderr
                    rate = tally.hit_tokens / max(1, tally.prompt_tokens)
                    line = f"\r{rid + 1} sent, {len(tally.load_s)} done, hit rate {rate:.1%}"
                    print(line, end="", file=sys.stderr, flush=True)
        if sys.stderr.isatty():
            print(file=sys.stderr)
        elapsed = anyio.current_time() - began
    done = len(tally.load_s)
    print(f"done: {done} of {args.requests} requests in {elapsed:.1f} s, {tally.failed} failed")
    print(
        f"hit rate: {tally.hit_tokens / tally.prompt_tokens:.1%} of prompt tokens; "
        f"{tally.hits} requests hit, {tally.exact} of their loads bit-exact"
    )
    print(f"lookup + load: {percentiles(tally.load_s)}")
    print(f"store: {percentiles(tally.store_s)}")
    return 0 if tally.failed == 0 and tally.exact == tally.hits else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="a running sidecar (default: start one)")
    parser.add_argument("--rate", type=float, default=100.0, help="requests per second")
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--shared", type=float, default=0.7, help="share on shared prefixes")
    parser.add_argument("--prefixes", type=int, default=4, help="shared prefixes")
    parser.add_argument("--prefix", type=int, default=512, help="tokens of a prefix")
    parser.add_argument("--suffix", type=int, default=64, help="new tokens per prompt")
    parser.add_argument("--max-in-flight", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    return anyio.run(run, parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
