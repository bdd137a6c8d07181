"""What ``bench --redis`` measures: the chunks' count and size, the rounds, the model whose
KV they hold, and the goals its ratios are held to."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Final

import torch

from lmcache_async.errors import InvalidInputError
from lmcache_async.keys.tokens import is_strict_int
from lmcache_async.layouts import KVLayout

__all__ = ["GOALS", "MODEL_NAME", "PLAIN_SCHEMES", "RedisBenchOptions"]

GOALS: Final[Mapping[str, float]] = {
    "retrieve_ratio": 1.3,
    "write_ratio": 1.3,
    "first_store_ratio": 1.5,
}
"""At most: a retrieve of chunks only in Redis over the plain socket's ``GET`` s, the
engine's write to Redis over its ``SET`` s, a fresh engine's first store over its
steady-state store (pool prefault on)."""

MODEL_NAME: Final = "lmcache-async-bench-redis"
"""The namespace of every chunk the benchmark stores (embedded and sidecar alike)."""

PLAIN_SCHEMES: Final = ("redis", "valkey", "unix")
"""The URLs of servers the plain socket reaches (no TLS, no cluster)."""

_LAYERS: Final = 6
_KV_HEADS: Final = 2
_HEAD_SIZE: Final = 128
_BLOCK_SIZE: Final = 16


@dataclass(frozen=True, slots=True)
class RedisBenchOptions:
    """The ``lmcache-async bench --redis`` settings. The KV is a 6-layer float32 model's
    with 2 KV heads of 128 (12 KiB a token), so 256-token chunks are 3 MiB."""

    chunks: int = 8
    """Chunks of the request stored and retrieved."""
    chunk_tokens: int = 256
    """Tokens per chunk (the engines' ``chunk_size``)."""
    rounds: int = 10
    """Measured rounds of the Redis part (after one warm-up round), and fresh engines of
    each kind in the first-store part."""
    seed: int = 0
    redis_url: str | None = None
    """An existing server (``redis://``, ``valkey://`` or ``unix://``); None: a
    ``redis-server`` started on a free loopback port for the run."""
    startup_timeout: float = 120.0
    """Seconds the sidecar gets to answer (it imports torch)."""
    timeout: float = 60.0
    """Seconds any one call (a store, a retrieve, a plain round trip) may take."""

    def validate(self) -> None:
        """Check every setting.

        Raises:
            InvalidInputError: a count that is not a positive int, a seed that is not an
                int, a timeout that is not positive, a URL of another scheme than
                :data:`PLAIN_SCHEMES`.
            ConfigError: a malformed ``redis_url``.
        """
        for name in ("chunks", "chunk_tokens", "rounds"):
            value = getattr(self, name)
            if not is_strict_int(value) or value < 1:
                raise InvalidInputError(f"{name} must be an int >= 1, got {value!r}")
        if not is_strict_int(self.seed):
            raise InvalidInputError(f"seed must be an int, got {self.seed!r}")
        for name in ("startup_timeout", "timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise InvalidInputError(f"{name} must be a positive number, got {value!r}")
        if self.redis_url is not None:
            # Here, not at the top: redis-py is an optional extra, and the CLI reads the
            # defaults above to build its flags.
            from lmcache_async.backends.redis_conn import parse_remote_url  # noqa: PLC0415

            parse_remote_url(self.redis_url)
            scheme = self.redis_url.partition("://")[0].lower()
            if scheme not in PLAIN_SCHEMES:
                raise InvalidInputError(
                    "--redis measures against a plain socket: give a redis://, valkey:// or "
                    f"unix:// URL, not {scheme}://"
                )

    def layout(self) -> KVLayout:
        """The KV layout of the model whose chunks are moved."""
        return KVLayout.vllm_flash_attn(
            num_layers=_LAYERS,
            block_size=_BLOCK_SIZE,
            num_kv_heads=_KV_HEADS,
            head_size=_HEAD_SIZE,
            dtype=torch.float32,
        )

    @property
    def tokens(self) -> int:
        """Tokens of the request."""
        return self.chunks * self.chunk_tokens

    @property
    def chunk_bytes(self) -> int:
        """Payload bytes of one chunk."""
        return self.chunk_tokens * self.layout().token_bytes

    @property
    def request_bytes(self) -> int:
        """Payload bytes of the request."""
        return self.chunks * self.chunk_bytes

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
