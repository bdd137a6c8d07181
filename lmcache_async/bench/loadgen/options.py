"""What a load run does: the workload, the target, the arrivals and the model shape."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

from lmcache_async import InvalidInputError, KVLayout
from lmcache_async.bench import parse_dtype
from lmcache_async.bench.vllm_target import VLLM_EXECUTORS, VllmSettings, check_vllm, read_model
from lmcache_async.bench.workloads import (
    WORKLOADS,
    LongDocQA,
    MultiRoundChat,
    RandomPrompts,
    Workload,
)

__all__ = [
    "ARRIVALS",
    "OPERATIONS",
    "SIDECAR_TIMEOUT",
    "TARGETS",
    "VLLM_OPERATIONS",
    "LoadOptions",
]

TARGETS: Final = ("embedded", "sidecar", "vllm")
ARRIVALS: Final = ("poisson", "fixed")
OPERATIONS: Final = ("lookup", "retrieve", "compute", "store", "request")
"""Timed steps; ``request`` is a whole request, from its arrival to its store's end."""
VLLM_OPERATIONS: Final = ("ttft", "request")
"""Timed steps of a vLLM request, both from its arrival: its first token and its end."""
SIDECAR_TIMEOUT: Final = 30.0
"""Seconds one sidecar request may take by default (a long prompt's KV is hundreds of MB)."""


@dataclass(frozen=True, slots=True)
class LoadOptions:
    """What to run, against what, and the model shape of the KV.

    The default model shape (16 layers, 8 KV heads of 64, bfloat16: 32 KiB of KV per token)
    is small enough for a 2-core machine and large enough that copies, not Python, dominate.
    """

    workload: str = "multi-round-chat"
    target: str = "embedded"
    url: str | None = None
    """The sidecar's ``ipc://`` or ``tcp://`` URL (target ``sidecar``; with target ``vllm``
    the connector keeps its cache there)."""
    model_name: str = "lmcache-async-bench"
    seed: int = 0
    duration: float = 8.0
    """Seconds during which new requests start; requests in flight then finish."""
    requests: int = 0
    """Start no more than this many requests (0: as many as ``duration`` allows)."""
    sidecar_timeout: float = SIDECAR_TIMEOUT
    """Target ``sidecar``: the client's timeout of one request."""
    store_ahead: bool = True
    """Target ``sidecar``: a request's pinned lookup sends its STORE ahead (a request
    stores its prompt after its lookup: :mod:`lmcache_async.rpc.client.ahead`)."""
    concurrency: int = 4
    rate: float = 0.0
    """Requests per second; 0: as fast as ``concurrency`` allows (closed loop)."""
    arrival: str = "poisson"
    users: int = 8
    system_prompt_tokens: int = 1024
    turn_tokens: int = 384
    """New tokens per turn (the previous answer plus the next question)."""
    max_context_tokens: int = 8192
    documents: int = 4
    questions: int = 4
    document_tokens: int = 2048
    question_tokens: int = 64
    min_prompt_tokens: int = 256
    max_prompt_tokens: int = 2048
    num_layers: int = 16
    num_kv_heads: int = 8
    head_size: int = 64
    dtype: str = "bfloat16"
    block_size: int = 16
    verify_every: int = 1
    """Check every n-th retrieve bit for bit on a sample of its tokens (0: never)."""
    vocab_size: int = 32000
    progress: bool = True
    """Show progress on stderr (tqdm when importable, else a line a second)."""
    model: str | None = None
    """Target ``vllm``: a local Hugging Face model directory."""
    max_tokens: int = 1
    """Target ``vllm``: tokens generated per request."""
    kv_cache_gb: float = 1.0
    """Target ``vllm``: vLLM's paged KV memory in GiB."""
    vllm_dtype: str = "auto"
    """Target ``vllm``: the model's dtype in vLLM (``auto``: the model config's)."""
    vllm_executor: str = "mp"
    """Target ``vllm``: ``mp`` (the worker in its own process) or ``uni``."""
    connector: bool = True
    """Target ``vllm``: False runs plain vLLM, a baseline without the cache."""

    def validate(self) -> None:
        """Check the options as a whole (the workload's sizes are checked by
        :meth:`make_workload`).

        Raises:
            InvalidInputError: an unknown name, a count or size out of range, an unknown
                dtype, a sidecar without a URL; for target ``vllm``: vLLM not installed,
                no usable ``model`` directory (the message says how to make one).
        """
        for name, value, allowed in (
            ("workload", self.workload, WORKLOADS),
            ("target", self.target, TARGETS),
            ("arrival", self.arrival, ARRIVALS),
            ("vllm_executor", self.vllm_executor, VLLM_EXECUTORS),
        ):
            if value not in allowed:
                raise InvalidInputError(f"{name} must be one of {', '.join(allowed)}: {value!r}")
        if self.target == "vllm":
            check_vllm()
            read_model(self.model)
            if self.max_tokens <= 0:
                raise InvalidInputError(f"max_tokens must be > 0, got {self.max_tokens}")
            if not (math.isfinite(self.kv_cache_gb) and self.kv_cache_gb > 0):
                raise InvalidInputError(f"kv_cache_gb must be > 0, got {self.kv_cache_gb!r}")
        if self.target == "sidecar" and not self.url:
            raise InvalidInputError("target sidecar needs the sidecar's url (--url)")
        positive = {
            "duration": self.duration,
            "concurrency": self.concurrency,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_size": self.head_size,
            "block_size": self.block_size,
        }
        for name, number in positive.items():
            if not number > 0:
                raise InvalidInputError(f"{name} must be > 0, got {number!r}")
        if isinstance(self.requests, bool) or not isinstance(self.requests, int):
            raise InvalidInputError(f"requests must be an int, got {self.requests!r}")
        if self.requests < 0:
            raise InvalidInputError(f"requests must be >= 0, got {self.requests}")
        if not (math.isfinite(self.sidecar_timeout) and self.sidecar_timeout > 0):
            raise InvalidInputError(
                f"sidecar_timeout must be a number > 0, got {self.sidecar_timeout!r}"
            )
        if not (math.isfinite(self.rate) and self.rate >= 0):
            raise InvalidInputError(f"rate must be a finite number >= 0, got {self.rate!r}")
        if self.verify_every < 0:
            raise InvalidInputError(f"verify_every must be >= 0, got {self.verify_every}")
        parse_dtype(self.dtype)

    def vllm_settings(self) -> VllmSettings:
        """The vLLM run of target ``vllm``.

        Raises:
            InvalidInputError: no ``model``.
        """
        if not self.model:
            read_model(self.model)  # raises, saying how to make a model
        return VllmSettings(
            model=str(self.model),
            max_tokens=self.max_tokens,
            kv_cache_gb=self.kv_cache_gb,
            dtype=self.vllm_dtype,
            executor=self.vllm_executor,
            connector=self.connector,
            seed=self.seed,
        )

    def layout(self) -> KVLayout:
        """The vLLM flash-attention layout of the benchmark model."""
        return KVLayout.vllm_flash_attn(
            num_layers=self.num_layers,
            block_size=self.block_size,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            dtype=parse_dtype(self.dtype),
        )

    def make_workload(self) -> Workload:
        """A fresh workload of the chosen kind and sizes.

        Raises:
            InvalidInputError: a size is out of range.
        """
        if self.workload == "multi-round-chat":
            return MultiRoundChat(
                seed=self.seed,
                users=self.users,
                system_prompt_tokens=self.system_prompt_tokens,
                turn_tokens=self.turn_tokens,
                max_context_tokens=self.max_context_tokens,
                vocab_size=self.vocab_size,
            )
        if self.workload == "long-doc-qa":
            return LongDocQA(
                seed=self.seed,
                documents=self.documents,
                questions=self.questions,
                document_tokens=self.document_tokens,
                question_tokens=self.question_tokens,
                vocab_size=self.vocab_size,
            )
        return RandomPrompts(
            seed=self.seed,
            min_tokens=self.min_prompt_tokens,
            max_tokens=self.max_prompt_tokens,
            vocab_size=self.vocab_size,
        )
