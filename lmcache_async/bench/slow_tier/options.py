"""What the slow-tier benchmark runs: its sizes, the link's rate and the model."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Final
from urllib.parse import urlsplit

from lmcache_async.errors import InvalidInputError
from lmcache_async.keys.tokens import is_strict_int

__all__ = ["DEFAULT_LINK_BYTES_PER_S", "SlowTierOptions", "redis_address"]

DEFAULT_LINK_BYTES_PER_S: Final = 5e6
"""5 MB/s: the small model's 2048-token prompt (4 MiB of KV) loads in about 0.8 s there,
about ten times what recomputing it takes on a 2-core CPU, so loading clearly loses."""


@dataclass(frozen=True, slots=True)
class SlowTierOptions:
    """The ``lmcache-async bench --vllm-slow-tier`` settings."""

    rounds: int = 5
    """Time-to-first-token rounds; each times the four configurations once."""
    prompt_tokens: int = 2048
    """Tokens of each cached prompt (and of the fresh ones recomputed beside them)."""
    link_bytes_per_s: float = DEFAULT_LINK_BYTES_PER_S
    """The proxy's rate between vLLM's connector and Redis, each way."""
    decode_tokens_before: int = 20
    """Tokens the decoding request generates before the slow load starts (its baseline
    steps are those after its first two)."""
    chunk_size: int = 256
    """The connector's chunk size, and vLLM's tokens per step (a prefill is cut in these)."""
    model: str | None = None
    """A local model directory; None: a small random-weight Llama built for the run."""
    redis_url: str | None = None
    """``redis://HOST:PORT`` of a Redis to use; None: a ``redis-server`` started for the run."""
    seed: int = 0
    kv_cache_gb: float = 0.5
    """vLLM's paged KV memory of each of the three engines, in GiB."""

    def validate(self) -> None:
        """Check every setting.

        Raises:
            InvalidInputError: a count is not a positive int, the rate or the KV memory is
                not a positive number, the prompt is shorter than two chunks, or the Redis
                URL is not ``redis://HOST:PORT``.
        """
        for name in ("rounds", "prompt_tokens", "decode_tokens_before", "chunk_size"):
            value = getattr(self, name)
            if not is_strict_int(value) or value < 1:
                raise InvalidInputError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("link_bytes_per_s", "kv_cache_gb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise InvalidInputError(f"{name} must be a number > 0, got {value!r}")
        if self.link_bytes_per_s == float("inf"):
            raise InvalidInputError("link_bytes_per_s must be finite")
        if self.prompt_tokens < 2 * self.chunk_size:
            raise InvalidInputError(
                f"prompt_tokens ({self.prompt_tokens}) must be at least two chunks "
                f"({2 * self.chunk_size}): a shorter prompt has too little to load"
            )
        if self.redis_url is not None:
            redis_address(self.redis_url)

    def as_dict(self) -> dict[str, Any]:
        """The settings as plain data (for the results)."""
        return asdict(self)


def redis_address(url: str) -> tuple[str, int]:
    """``(host, port)`` of a ``redis://HOST:PORT`` URL (the proxy forwards to it).

    Raises:
        InvalidInputError: another scheme, or no host or port.
    """
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "redis" or not parts.hostname or port is None:
        raise InvalidInputError(f"--redis-url must be redis://HOST:PORT here, got {url!r}")
    return parts.hostname, port
