"""Store a prompt through an engine with a disk tier, in its own process (used by the
restart test): ``python tier_store_script.py DIRECTORY TOKENS SEED``."""

from __future__ import annotations

import sys

import anyio

from lmcache_async import CacheEngine


async def main(directory: str, n: int, seed: int) -> None:
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from test_engine_tiers import config, layout, slots_of, source_caches, tokens_of

    async with CacheEngine.open(config(directory), layout(), model_name="tiers-test") as engine:
        stored = await engine.store(
            tokens_of(n, seed), kv_caches=source_caches(seed), slot_mapping=slots_of(n, seed)
        )
        await engine.flush()
    print(f"stored {stored}")


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
