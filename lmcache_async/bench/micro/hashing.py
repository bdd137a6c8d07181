"""Tokens/s of the chunk key chain next to the plain way to get the same digests."""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable, Mapping
from typing import Any, Final

import blake3
import torch
import xxhash

from lmcache_async.bench.baselines import timed
from lmcache_async.bench.micro.options import TARGETS, VOCAB, MicroOptions
from lmcache_async.keys.chunks import (
    LINK_SIZE,
    NATIVE_CHAIN,
    ChunkHasher,
    HashAlgorithm,
    Namespace,
)
from lmcache_async.keys.hashing import with_tag

__all__ = ["HASH_ALGORITHMS", "hash_bench"]

HASH_ALGORITHMS: Final = ("blake3", "xxh3_128")


def hash_bench(options: MicroOptions, chunk_size: int, gen: torch.Generator) -> dict[str, Any]:
    """Tokens/s of ``ChunkHasher.digests`` on a list and on an int64 tensor."""
    n = options.lookup_tokens
    as_tensor = torch.randint(0, VOCAB, (n,), generator=gen, dtype=torch.int64)
    as_list = as_tensor.tolist()
    layout = options.layout()
    out: dict[str, Any] = {
        "tokens": n,
        "iterations": options.hash_iterations,
        "chunk_size": chunk_size,
    }
    problems: list[str] = []
    for algorithm in HASH_ALGORITHMS:
        namespace = Namespace(
            model_name="lmcache-async-micro", layout_fingerprint=layout.fingerprint
        )
        hasher = ChunkHasher(namespace, chunk_size=chunk_size, algorithm=HashAlgorithm(algorithm))
        entry: dict[str, Any] = {}
        plain = _PLAIN_CHAINS[algorithm]
        seed = hasher.seed
        # The hasher's keys are the chain's digests with the tenant tag in front.
        if with_tag(plain(seed, as_tensor, chunk_size), hasher.tag) != hasher.digests(as_tensor):
            problems.append(f"{algorithm}: the plain chain gives other digests than the hasher")
        runs = options.hash_iterations
        from_list, _ = _paired_times(functools.partial(hasher.digests, as_list), None, runs)
        from_tensor, from_plain = _paired_times(
            functools.partial(hasher.digests, as_tensor),
            functools.partial(plain, seed, as_tensor, chunk_size),
            runs,
        )
        samples = {"list": from_list, "tensor": from_tensor}
        for name, times in samples.items():
            rate = n / statistics.median(times) / 1e6
            entry[f"{name}_mtps"] = rate
            entry[f"{name}_ok"] = rate >= TARGETS[f"hash_{name}_mtps"]
        entry["tensor_plain_mtps"] = n / statistics.median(from_plain) / 1e6
        entry["tensor_ratio"] = entry["tensor_mtps"] / entry["tensor_plain_mtps"]
        out[algorithm] = entry
    out["native_chain"] = NATIVE_CHAIN
    out["target_list_mtps"] = TARGETS["hash_list_mtps"]
    out["target_tensor_mtps"] = TARGETS["hash_tensor_mtps"]
    out["problems"] = problems
    return out


def _plain_blake3(seed: bytes, tokens: torch.Tensor, chunk_size: int) -> list[bytes]:
    """The plain way to chain blake3 over a token tensor's chunks, with the blake3
    package (the hashing baseline)."""
    data = tokens.to(torch.int32).numpy().tobytes()
    step = chunk_size * 4
    digests: list[bytes] = []
    prev = seed
    for offset in range(0, len(data), step):
        prev = blake3.blake3(data[offset : offset + step] + prev).digest(length=LINK_SIZE)
        digests.append(prev)
    return digests


def _plain_xxh3(seed: bytes, tokens: torch.Tensor, chunk_size: int) -> list[bytes]:
    """As :func:`_plain_blake3`, with xxh3-128 (a loop of its own: a hash function passed
    in would cost the baseline one more call per chunk)."""
    data = tokens.to(torch.int32).numpy().tobytes()
    step = chunk_size * 4
    digests: list[bytes] = []
    prev = seed
    for offset in range(0, len(data), step):
        prev = xxhash.xxh3_128_digest(data[offset : offset + step] + prev)
        digests.append(prev)
    return digests


_PlainChain = Callable[[bytes, torch.Tensor, int], list[bytes]]
_PLAIN_CHAINS: Final[Mapping[str, _PlainChain]] = {
    "blake3": _plain_blake3,
    "xxh3_128": _plain_xxh3,
}


def _paired_times(
    first: Callable[[], object], second: Callable[[], object] | None, runs: int
) -> tuple[list[float], list[float]]:
    """Seconds of ``runs`` calls of ``first`` and of ``second`` (when given), one of each
    in turn after three warm-up calls each: a machine that speeds up or slows down while
    they are measured weighs on both alike."""
    for _ in range(3):
        first()
        if second is not None:
            second()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(runs):
        times[0].append(timed(first))
        if second is not None:
            times[1].append(timed(second))
    return times
