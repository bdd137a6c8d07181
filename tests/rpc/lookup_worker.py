"""A worker process for the lookup-service tests: a CPU CacheEngine behind a LookupServer.

It stores the first ``--store`` tokens of :func:`prompt` (``--prompt-len`` tokens), serves
lookups, prints ``READY <endpoint>`` on stdout and runs until SIGTERM or SIGINT, then closes
the server (which removes its socket file) and the engine.
"""

from __future__ import annotations

import argparse
import signal
import sys

import anyio
import torch

from lmcache_async import CacheEngine, EngineConfig, KVLayout
from lmcache_async.logging import configure_logging
from lmcache_async.rpc.lookup import LookupServer
from lmcache_async.rpc.protocol import MessageLimits

BLOCK_SIZE = 16
LAYOUT = KVLayout.vllm_flash_attn(
    num_layers=2, num_kv_heads=2, head_size=16, block_size=BLOCK_SIZE, dtype=torch.float16
)


def prompt(length: int) -> list[int]:
    """The token ids every test process agrees on (conftest.prompt is the same)."""
    return [(i * 7919 + 13) % 50_000 for i in range(length)]


def block_hashes(num_tokens: int, chunk_size: int) -> tuple[list[int], list[int]]:
    """Serving-engine block hashes (wider than 64 bits) and end offsets for ``num_tokens``."""
    offsets = [*range(chunk_size, num_tokens, chunk_size), num_tokens]
    return [2**200 + i for i in range(len(offsets))], offsets


async def store(engine: CacheEngine, num_tokens: int, seed: int, **keys: list[int]) -> None:
    generator = torch.Generator().manual_seed(seed)
    kv_caches = LAYOUT.allocate_kv_caches(-(-num_tokens // BLOCK_SIZE), generator=generator)
    slots = torch.arange(num_tokens)
    stored = await engine.store(kv_caches=kv_caches, slot_mapping=slots, **keys)  # type: ignore[arg-type]
    if stored != num_tokens:
        raise SystemExit(f"stored {stored} of {num_tokens} tokens")


async def run(args: argparse.Namespace) -> None:
    config = EngineConfig(chunk_size=args.chunk_size, max_local_cpu_size=args.cpu_gb)
    limits = MessageLimits(
        max_header_bytes=args.max_header_bytes, max_payload_bytes=args.max_payload_bytes
    )
    async with CacheEngine.open(config, LAYOUT, model_name="rpc-test") as engine:
        if args.store:
            tokens = prompt(args.prompt_len)[: args.store]
            await store(engine, args.store, args.rank, tokens=tokens)
        if args.hash_store:
            hashes, offsets = block_hashes(args.hash_store, args.chunk_size)
            await store(engine, args.hash_store, args.rank, hashes=hashes, offsets=offsets)
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with LookupServer.serve(
                engine,
                instance_id=args.instance,
                rank=args.rank,
                socket_dir=args.socket_dir,
                limits=limits,
            ) as server:
                print("READY", server.endpoint, flush=True)
                async for _ in signals:
                    break


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--instance", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--socket-dir", required=True)
    parser.add_argument("--prompt-len", type=int, default=0)
    parser.add_argument("--store", type=int, default=0)
    parser.add_argument("--hash-store", type=int, default=0)
    parser.add_argument("--chunk-size", type=int, default=16)
    parser.add_argument("--cpu-gb", type=float, default=0.01)
    parser.add_argument("--max-header-bytes", type=int, default=64 * 1024)
    parser.add_argument("--max-payload-bytes", type=int, default=1 << 20)
    args = parser.parse_args()
    configure_logging("WARNING", stream=sys.stderr)
    anyio.run(run, args)


if __name__ == "__main__":
    main()
