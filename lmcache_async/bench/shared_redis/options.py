"""What the shared-Redis benchmark runs: the prompts' sizes, the chunk and block sizes,
the tokens generated, and where the model and the logs go."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Final

from lmcache_async.bench.routing.options import check_prompt_sizes
from lmcache_async.config import GB
from lmcache_async.errors import InvalidInputError
from lmcache_async.keys.tokens import is_strict_int

__all__ = ["PHASES", "RATIO_GOAL", "SharedRedisOptions"]

PHASES: Final = ("a-cold", "a-warm", "b-redis", "b-warm")
"""The phases, in the order they run: each prompt to A computed (stored into A's RAM and,
behind it, Redis); to A again (a hit in A's own RAM); to B, which never saw it (a hit read
from Redis); to B again (a hit in B's RAM, filled by the read)."""

RATIO_GOAL: Final = 1.5
"""B's mean time to first token from Redis over A's warm one that the benchmark aims at."""

_CPU_TIER_SLACK: Final = 2.0
"""Each sidecar's RAM tier holds this many times every prompt's KV (nothing is evicted)."""

_RESERVED_BLOCKS: Final = 4
"""vLLM KV blocks beyond one request's: its null block and some room."""


@dataclass(frozen=True, slots=True)
class SharedRedisOptions:
    """The ``lmcache-async bench --shared-redis`` settings."""

    prefixes: int = 8
    """Prompts, each sent in every phase (one more, first, warms the path up, uncounted)."""
    prefix_tokens: int = 1024
    """Tokens of each prompt's cached part (whole chunks)."""
    suffix_tokens: int = 8
    """Tokens after the prefix, fewer than a chunk: the prompt's last token is always
    computed, so the whole prefix can hit."""
    max_tokens: int = 8
    """Tokens generated (greedy) per request; A's warm ones and B's are compared."""
    warmup_prompts: int = 4
    """Prompts of its own each host serves twice (computed, then a hit in its RAM) before
    the phases, uncounted, so that neither server is timed on its first requests: without
    them A's warm hits would follow nine requests of its own and B's Redis hits one."""
    seed: int = 0
    block_size: int = 32
    """vLLM's block size."""
    chunk_size: int = 64
    """The connector's and the sidecars' chunk size."""
    model: str | None = None
    """A local model directory; None: the routing benchmark's random-weight Llama, built
    for the run."""
    work_dir: str | None = None
    """Where the model (when built) and the logs go; None: a temporary directory."""

    def validate(self) -> None:
        """Check every setting.

        Raises:
            InvalidInputError: a count is not a positive int, a chunk that is not whole
                blocks, a prefix that is not whole chunks, or a suffix not below a chunk.
        """
        if (
            isinstance(self.warmup_prompts, bool)
            or not isinstance(self.warmup_prompts, int)
            or self.warmup_prompts < 0
        ):
            raise InvalidInputError(
                f"warmup_prompts must be an int >= 0, got {self.warmup_prompts!r}"
            )
        for name in (
            "prefixes",
            "prefix_tokens",
            "suffix_tokens",
            "max_tokens",
            "block_size",
            "chunk_size",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidInputError(f"{name} must be an int >= 1, got {value!r}")
        if not is_strict_int(self.seed):
            raise InvalidInputError(f"seed must be an int, got {self.seed!r}")
        check_prompt_sizes(self.block_size, self.chunk_size, self.prefix_tokens)
        if self.suffix_tokens >= self.chunk_size:
            raise InvalidInputError(
                f"suffix_tokens ({self.suffix_tokens}) must be below chunk_size ({self.chunk_size})"
            )

    @property
    def prompt_tokens(self) -> int:
        return self.prefix_tokens + self.suffix_tokens

    @property
    def max_model_len(self) -> int:
        """A prompt and its generated tokens, rounded up to whole blocks."""
        tokens = self.prompt_tokens + self.max_tokens
        return math.ceil(tokens / self.block_size) * self.block_size

    @property
    def vllm_blocks(self) -> int:
        """vLLM's KV cache: one request at a time (its prefix cache is off)."""
        return self.max_model_len // self.block_size + _RESERVED_BLOCKS

    @property
    def chunks(self) -> int:
        """Chunks every prompt, the warm-up one too, stores."""
        return (self.prefixes + 1) * self._prompt_chunks

    @property
    def redis_chunks(self) -> int:
        """Chunks in Redis before B is asked: A's prompts and both hosts' warm-up ones."""
        return self.chunks + 2 * self.warmup_prompts * self._prompt_chunks

    @property
    def _prompt_chunks(self) -> int:
        return self.prefix_tokens // self.chunk_size

    def cpu_tier_gb(self, kv_bytes_per_token: int) -> float:
        """Each sidecar's RAM tier (GB of 1024**3 bytes): every prompt's KV, its own
        warm-up prompts' too, with slack."""
        prompts = self.prefixes + 1 + self.warmup_prompts
        nbytes = prompts * self.prompt_tokens * kv_bytes_per_token
        return _CPU_TIER_SLACK * nbytes / GB

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
