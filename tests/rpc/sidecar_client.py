"""A client process for the sidecar tests.

Modes (``--mode``):

- ``store``: store the first ``--tokens`` tokens of :func:`prompt` with KV drawn from
  ``--seed``; print ``{"stored": n, "shm": bool}``;
- ``retrieve``: look the prompt up and retrieve it into zeroed caches, then compare every
  loaded token's KV bit for bit with the KV ``--seed`` draws; print ``{"hits": n,
  "retrieved": n, "exact": bool, "shm": bool}``.

Exit status 0 on success; the JSON line is the last line of stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import anyio
import torch

from lmcache_async import KVLayout, RemoteCacheEngine
from lmcache_async.logging import configure_logging

BLOCK_SIZE = 16
LAYOUT = KVLayout.vllm_flash_attn(
    num_layers=2, num_kv_heads=2, head_size=16, block_size=BLOCK_SIZE, dtype=torch.float16
)
MODEL = "sidecar-test"


def prompt(length: int, salt: int = 0) -> list[int]:
    """The token ids every test process agrees on (test_sidecar.prompt is the same)."""
    return [(i * 7919 + 13 + salt) % 50_000 for i in range(length)]


def kv_for(num_tokens: int, seed: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Caches holding ``num_tokens`` tokens of KV drawn from ``seed``, and their slots."""
    generator = torch.Generator().manual_seed(seed)
    blocks = -(-num_tokens // BLOCK_SIZE)
    return LAYOUT.allocate_kv_caches(blocks, generator=generator), torch.arange(num_tokens)


def payload_of(kv_caches: list[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
    out = torch.empty(LAYOUT.payload_shape(len(slots)), dtype=LAYOUT.dtype)
    LAYOUT.gather(kv_caches, slots, out)
    return out


async def store(args: argparse.Namespace) -> dict[str, Any]:
    kv, slots = kv_for(args.tokens, args.seed)
    async with RemoteCacheEngine.connect(
        args.url, LAYOUT, model_name=MODEL, timeout=args.timeout, name="store-client"
    ) as engine:
        stored = await engine.store(
            prompt(args.tokens, args.salt), kv_caches=kv, slot_mapping=slots
        )
        return {"stored": stored, "shm": engine.uses_shared_memory}


async def retrieve(args: argparse.Namespace) -> dict[str, Any]:
    expected, slots = kv_for(args.tokens, args.seed)
    target = LAYOUT.allocate_kv_caches(-(-args.tokens // BLOCK_SIZE), random=False)
    tokens = prompt(args.tokens, args.salt)
    async with RemoteCacheEngine.connect(
        args.url, LAYOUT, model_name=MODEL, timeout=args.timeout, name="retrieve-client"
    ) as engine:
        hits = await engine.lookup(tokens)
        mask = await engine.retrieve(tokens, kv_caches=target, slot_mapping=slots)
        retrieved = int(mask.sum())
        loaded = slots[mask]
        exact = bool(
            torch.equal(payload_of(target, loaded), payload_of(expected, loaded)) and retrieved > 0
        )
        return {
            "hits": hits,
            "retrieved": retrieved,
            "exact": exact,
            "shm": engine.uses_shared_memory,
        }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--mode", choices=("store", "retrieve"), required=True)
    parser.add_argument("--tokens", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--salt", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=10.0)
    args = parser.parse_args()
    configure_logging("WARNING", stream=sys.stderr)
    result = anyio.run(store if args.mode == "store" else retrieve, args)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
