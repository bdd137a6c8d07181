"""What a trace replay does: the trace, the target, the pace, the tiers and the model shape."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

from lmcache_async.bench import parse_dtype
from lmcache_async.bench.loadgen import TARGETS, LoadOptions
from lmcache_async.bench.vllm_target import VLLM_EXECUTORS, check_vllm, read_model
from lmcache_async.errors import InvalidInputError

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_REQUEST_TIMEOUT",
    "DEFAULT_VOCAB",
    "TraceOptions",
    "parse_capacities",
]

DEFAULT_BLOCK_SIZE: Final = 512
"""Tokens per hash id in Mooncake's traces."""
DEFAULT_VOCAB: Final = 32000
"""Token ids are below this for the embedded and sidecar targets (they are only hashed)."""
DEFAULT_REQUEST_TIMEOUT: Final = 600.0
"""Seconds one request may take before it counts as failed (a long prompt on a CPU vLLM)."""

_SUFFIXES: Final = {"k": 1e3, "m": 1e6, "g": 1e9}


def parse_capacities(text: str) -> tuple[int, ...]:
    """Token counts from ``"0.5M,1M,3M,10M"`` (k, M, G: thousands, millions, billions).

    Raises:
        InvalidInputError: an entry is not a positive number of tokens.
    """
    out: list[int] = []
    for raw in text.split(","):
        entry = raw.strip()
        scale = _SUFFIXES.get(entry[-1:].lower(), 1.0)
        number = entry[:-1] if scale != 1.0 else entry
        try:
            value = float(number) * scale
        except ValueError:
            raise InvalidInputError(
                f"a capacity is a number of tokens (1M, 512k), got {entry!r}"
            ) from None
        if not (math.isfinite(value) and value >= 1):
            raise InvalidInputError(f"a capacity must be >= 1 token, got {entry!r}")
        out.append(round(value))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class TraceOptions:
    """A replay of the trace at ``path`` (see :mod:`lmcache_async.bench.trace`).

    The model shape is the KV the embedded and sidecar targets store (16 layers, 8 KV heads
    of 64, bfloat16 by default: 32 KiB per token, so a tier of 1M tokens is 32 GiB); a small
    shape (``num_layers=1, num_kv_heads=2, head_size=16, dtype="float16"``: 128 bytes per
    token) replays a production trace on a laptop, and the sizing table still gives the
    bytes of the default shape's tiers.
    """

    path: str
    block_size: int = DEFAULT_BLOCK_SIZE
    """Tokens per hash id; the engine's chunk size."""
    limit: int | None = None
    """Replay the first ``limit`` requests only."""
    target: str = "embedded"
    url: str | None = None
    """Target ``sidecar``: its URL (None: start one); target ``vllm``: the connector's
    sidecar (None: the cache is embedded in vLLM's worker)."""
    model_name: str = "lmcache-async-bench-trace"
    seed: int = 0
    concurrency: int = 1
    speed: float | None = None
    """Replay at the trace's timestamps, ``speed`` times real time (None: closed loop)."""
    cpu_tokens: int | None = None
    """The CPU tier in tokens (rounded down to blocks); None: the configuration's size, or
    with a disk tier room for ``concurrency + 1`` of the longest prompts."""
    disk_tokens: int | None = None
    """A disk tier of this many tokens behind the CPU tier (None: the configuration's)."""
    capacities: tuple[int, ...] = ()
    """Capacities in tokens to sweep: the CPU tier's, or the disk tier's with one."""
    sweep_replay: bool = False
    """Replay the trace at each capacity too (else only the block LRU is computed)."""
    vocab_size: int | None = None
    """Token ids are below this (None: 32000, or the model's vocabulary for vLLM)."""
    num_layers: int = 16
    num_kv_heads: int = 8
    head_size: int = 64
    dtype: str = "bfloat16"
    kv_block_size: int = 16
    """Tokens per block of the paged KV memory the replay loads into."""
    verify_every: int = 1
    progress: bool = True
    work_dir: str | None = None
    """Where the disk tier's directory goes (None: a temporary directory)."""
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT
    sidecar_timeout: float = 30.0
    store_ahead: bool = True
    """Target ``sidecar``: as :attr:`LoadOptions.store_ahead`."""
    beside_embedded: bool = False
    """Target ``sidecar``: each request also goes to an embedded engine of the same tiers,
    right before or after (alternately), and the two are reported side by side: their
    ratio is of one moment of the machine, not of two runs."""
    model: str | None = None
    max_tokens: int = 1
    """Target ``vllm``: the cap on each request's ``output_length``."""
    kv_cache_gb: float = 1.0
    vllm_dtype: str = "auto"
    vllm_executor: str = "mp"
    connector: bool = True

    @property
    def disk(self) -> bool:
        """Whether this replay adds a disk tier of its own."""
        return self.disk_tokens is not None

    def validate(self) -> None:
        """Check the options as a whole.

        Raises:
            InvalidInputError: a name, count or size is out of range, a sweep that would
                resize a sidecar it did not start, or for target ``vllm``: vLLM missing or
                no usable model.
        """
        if self.target not in TARGETS:
            raise InvalidInputError(f"target must be one of {', '.join(TARGETS)}: {self.target!r}")
        if self.vllm_executor not in VLLM_EXECUTORS:
            allowed = ", ".join(VLLM_EXECUTORS)
            raise InvalidInputError(f"vllm_executor must be one of {allowed}")
        positive = {
            "block_size": self.block_size,
            "concurrency": self.concurrency,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_size": self.head_size,
            "kv_block_size": self.kv_block_size,
            "request_timeout": self.request_timeout,
            "sidecar_timeout": self.sidecar_timeout,
            "max_tokens": self.max_tokens,
        }
        for name, value in positive.items():
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise InvalidInputError(f"{name} must be > 0, got {value!r}")
        if self.limit is not None and self.limit < 0:
            raise InvalidInputError(f"limit must be >= 0, got {self.limit}")
        if self.speed is not None and not (math.isfinite(self.speed) and self.speed > 0):
            raise InvalidInputError(f"speed must be > 0, got {self.speed!r}")
        for name, tokens in (("cpu_tokens", self.cpu_tokens), ("disk_tokens", self.disk_tokens)):
            if tokens is not None and tokens < self.block_size:
                raise InvalidInputError(
                    f"{name} must hold one block of {self.block_size} tokens, got {tokens}"
                )
        for tokens in self.capacities:
            if tokens < self.block_size:
                raise InvalidInputError(
                    f"a capacity must hold one block of {self.block_size} tokens, got {tokens}"
                )
        if self.verify_every < 0:
            raise InvalidInputError(f"verify_every must be >= 0, got {self.verify_every}")
        if self.vocab_size is not None and self.vocab_size < 2:
            raise InvalidInputError(f"the vocabulary must be >= 2 tokens, got {self.vocab_size}")
        if self.sweep_replay:
            if not self.capacities:
                raise InvalidInputError("a replay at each capacity needs --capacities")
            if self.url is not None:
                raise InvalidInputError(
                    "a replay at each capacity resizes the cache: it starts its own sidecar, "
                    "so leave out --url"
                )
        if self.beside_embedded and (self.target != "sidecar" or self.disk):
            raise InvalidInputError(
                "--beside-embedded compares a sidecar with an embedded engine of the same "
                "CPU tier: it takes --target sidecar and no disk tier"
            )
        parse_dtype(self.dtype)
        if self.target == "vllm":
            check_vllm()
            read_model(self.model)
            if not (math.isfinite(self.kv_cache_gb) and self.kv_cache_gb > 0):
                raise InvalidInputError(f"kv_cache_gb must be > 0, got {self.kv_cache_gb!r}")

    def load_options(self, *, url: str | None = None, vocab_size: int | None = None) -> LoadOptions:
        """The load generator's options for the same target and shape, so its runners and
        targets serve the replay (``url``: the sidecar to use, when the replay started one;
        ``vocab_size``: the vocabulary the prompts were drawn from)."""
        return LoadOptions(
            target=self.target,
            url=url if url is not None else self.url,
            model_name=self.model_name,
            seed=self.seed,
            sidecar_timeout=self.sidecar_timeout,
            store_ahead=self.store_ahead,
            concurrency=self.concurrency,
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            dtype=self.dtype,
            block_size=self.kv_block_size,
            verify_every=self.verify_every,
            vocab_size=vocab_size or self.vocab_size or DEFAULT_VOCAB,
            progress=False,
            model=self.model,
            max_tokens=self.max_tokens,
            kv_cache_gb=self.kv_cache_gb,
            vllm_dtype=self.vllm_dtype,
            vllm_executor=self.vllm_executor,
            connector=self.connector,
        )
