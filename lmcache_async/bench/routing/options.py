"""What the routing benchmark runs: the workload's sizes, the two caches' sizes (in
prefixes) and where the model and the logs go; and those cache sizes in vLLM's and the
connector's units."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Final, NamedTuple

from lmcache_async.config import GB
from lmcache_async.errors import InvalidInputError
from lmcache_async.keys.tokens import is_strict_int

__all__ = ["POLICIES", "CacheSizes", "RoutingOptions"]

POLICIES: Final = ("round-robin", "gpu-events", "all-tiers")
"""The routing policies, in the order they run and are reported (round robin first: the
others' baseline)."""

_RESERVED_BLOCKS: Final = 2
"""vLLM KV blocks beyond the cached prefixes: vLLM's null block and the running request's
last, partly filled block."""


class CacheSizes(NamedTuple):
    """The two caches of each server in their own units."""

    vllm_blocks: int
    """vLLM's KV cache (``--num-gpu-blocks-override``)."""
    max_model_len: int
    """A prompt and its one generated token, rounded up to whole blocks."""
    cpu_tier_gb: float
    """The connector's host tier (``max_local_cpu_size``, GB of 1024**3 bytes)."""


@dataclass(frozen=True, slots=True)
class RoutingOptions:
    """The ``lmcache-async bench --routing`` settings.

    The caches are sized in prefixes: by default vLLM's KV cache holds a quarter of them
    and each CPU tier 60 %, so round robin, which sends every prefix to both servers,
    overflows both, while a router that keeps each prefix on one server needs only half
    of them in each CPU tier.
    """

    prefixes: int = 16
    """Shared prefixes the requests draw from."""
    prefix_tokens: int = 512
    """Tokens of each prefix (whole blocks and whole chunks)."""
    suffix_tokens: int = 16
    """Unique tokens after the prefix, fewer than a block: never cached anywhere."""
    requests: int = 96
    """Requests of each policy, sent one at a time."""
    seed: int = 0
    vllm_cache_prefixes: int | None = None
    """Prefixes vLLM's KV cache holds (None: a quarter of ``prefixes``)."""
    cpu_tier_prefixes: int | None = None
    """Prefixes each server's CPU tier holds (None: 60 % of ``prefixes``)."""
    block_size: int = 32
    """vLLM's block size, and the indexer's."""
    chunk_size: int = 64
    """The connector's chunk size."""
    model: str | None = None
    """A local model directory; None: a small random-weight Llama built for the run."""
    work_dir: str | None = None
    """Where the model (when built) and the servers' and indexers' logs go; None: a
    temporary directory removed after the run."""
    policies: tuple[str, ...] = POLICIES
    """The policies to run, a subset of :data:`POLICIES` (run in that order)."""

    def validate(self) -> None:
        """Check every setting.

        Raises:
            InvalidInputError: a count is not a positive int, fewer than two prefixes, a
                prefix that is not whole blocks and chunks, a suffix that is not shorter
                than a block, a chunk that is not whole blocks, a cache of no prefix or
                one that holds every prefix, or an unknown policy.
        """
        for name in (
            "prefixes",
            "prefix_tokens",
            "suffix_tokens",
            "requests",
            "block_size",
            "chunk_size",
        ):
            _positive(name, getattr(self, name))
        if not is_strict_int(self.seed):
            raise InvalidInputError(f"seed must be an int, got {self.seed!r}")
        if self.prefixes < 2:
            raise InvalidInputError(f"prefixes must be at least 2, got {self.prefixes}")
        check_prompt_sizes(self.block_size, self.chunk_size, self.prefix_tokens)
        if self.suffix_tokens >= self.block_size:
            raise InvalidInputError(
                f"suffix_tokens ({self.suffix_tokens}) must be below block_size "
                f"({self.block_size}): a unique block would be cached and never reused"
            )
        for name, value in (
            ("vllm_cache_prefixes", self.vllm_cache_prefixes),
            ("cpu_tier_prefixes", self.cpu_tier_prefixes),
        ):
            if value is not None:
                _positive(name, value)
        if self.vllm_prefixes >= self.prefixes or self.cpu_prefixes >= self.prefixes:
            raise InvalidInputError(
                f"each cache must hold fewer than the {self.prefixes} prefixes (vLLM's "
                f"{self.vllm_prefixes}, the CPU tier's {self.cpu_prefixes}): routing "
                "gains nothing where one server holds them all"
            )
        unknown = [name for name in self.policies if name not in POLICIES]
        if unknown or not self.policies:
            raise InvalidInputError(
                f"policies must be some of {', '.join(POLICIES)}, got {list(self.policies)}"
            )

    @property
    def vllm_prefixes(self) -> int:
        """Prefixes vLLM's KV cache holds."""
        if self.vllm_cache_prefixes is not None:
            return self.vllm_cache_prefixes
        return max(1, self.prefixes // 4)

    @property
    def cpu_prefixes(self) -> int:
        """Prefixes each CPU tier holds."""
        if self.cpu_tier_prefixes is not None:
            return self.cpu_tier_prefixes
        return max(1, round(self.prefixes * 0.6))

    @property
    def prompt_tokens(self) -> int:
        """Tokens of every request's prompt."""
        return self.prefix_tokens + self.suffix_tokens

    def sizes(self, kv_bytes_per_token: int) -> CacheSizes:
        """The caches in vLLM's blocks and the connector's GB for a model whose KV takes
        ``kv_bytes_per_token`` bytes a token."""
        blocks_per_prefix = self.prefix_tokens // self.block_size
        cpu_bytes = self.cpu_prefixes * self.prefix_tokens * kv_bytes_per_token
        return CacheSizes(
            vllm_blocks=self.vllm_prefixes * blocks_per_prefix + _RESERVED_BLOCKS,
            max_model_len=math.ceil((self.prompt_tokens + 1) / self.block_size) * self.block_size,
            cpu_tier_gb=cpu_bytes / GB,
        )

    def as_dict(self) -> dict[str, Any]:
        """The settings as plain data (for the results), the derived cache sizes too."""
        return {
            **asdict(self),
            "policies": list(self.policies),
            "vllm_cache_prefixes": self.vllm_prefixes,
            "cpu_tier_prefixes": self.cpu_prefixes,
        }


def check_prompt_sizes(block_size: int, chunk_size: int, prefix_tokens: int) -> None:
    """Prefixes of whole chunks of whole blocks.

    Raises:
        InvalidInputError: ``chunk_size`` is not a multiple of ``block_size``, or
            ``prefix_tokens`` not a multiple of ``chunk_size``.
    """
    if chunk_size % block_size:
        raise InvalidInputError(
            f"chunk_size ({chunk_size}) must be a multiple of block_size ({block_size})"
        )
    if prefix_tokens % chunk_size:
        raise InvalidInputError(
            f"prefix_tokens ({prefix_tokens}) must be a multiple of chunk_size "
            f"({chunk_size}): only whole chunks are cached"
        )


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidInputError(f"{name} must be an int >= 1, got {value!r}")
