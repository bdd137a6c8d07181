"""The flags of ``lmcache-async bench --redis`` (Redis at the wire's speed)."""

from __future__ import annotations

from typing import Any

__all__ = ["add_redis_flags"]


def add_redis_flags(bench: Any) -> None:
    """Add the ``--redis`` settings, as their own group, to the ``bench`` parser."""
    from lmcache_async.bench.redis.options import RedisBenchOptions  # noqa: PLC0415

    rbo = RedisBenchOptions()
    group = bench.add_argument_group(
        "Redis at the wire (--redis; also takes --chunk-size, default "
        f"{rbo.chunk_tokens} tokens of 12 KiB, --redis-url, --seed)"
    )
    group.add_argument(
        "--redis-chunks",
        type=int,
        default=rbo.chunks,
        metavar="N",
        help="chunks of the request written to and read from Redis",
    )
    group.add_argument(
        "--redis-rounds",
        type=int,
        default=rbo.rounds,
        metavar="N",
        help="rounds of the Redis part (after a warm-up round), and fresh engines of each "
        "kind in the first-store part",
    )
