"""The counts and latencies a load run collects, one request at a time."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lmcache_async.bench.loadgen.options import OPERATIONS

__all__ = ["Tally"]


@dataclass(slots=True)
class Tally:
    """Everything the run counts; mutated only from the event loop.

    A vLLM run (``operations`` :data:`~lmcache_async.bench.loadgen.VLLM_OPERATIONS`) counts
    the tokens the connector loaded as ``lookup_hit_tokens`` too (the connector's hit rate
    is loaded over prompt tokens) and the tokens it offered vLLM as ``external_tokens``.
    """

    operations: tuple[str, ...] = OPERATIONS
    requests: int = 0
    lookups: int = 0
    prompt_tokens: int = 0
    lookup_hit_tokens: int = 0
    retrieves: int = 0
    tokens_loaded: int = 0
    retrieve_short: int = 0
    stores: int = 0
    tokens_stored: int = 0
    store_requested_tokens: int = 0
    partial_stores: int = 0
    verified: int = 0
    verify_failures: int = 0
    external_tokens: int = 0
    load_failed_tokens: int = 0
    output_tokens: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    latency: dict[str, list[float]] = field(init=False)
    samples: dict[str, list[float]] = field(init=False)
    """One entry per finished request, columnar: its start (seconds into the run), token
    counts and each step's latency (nan when the step did not run)."""

    def __post_init__(self) -> None:
        self.latency = {op: [] for op in self.operations}
        columns = ("t", "prompt_tokens", "hit_tokens", "loaded_tokens", "failed")
        self.samples = {name: [] for name in (*columns, *(f"{op}_ms" for op in self.operations))}

    def progress_text(self) -> str:
        rate = self.lookup_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        errors = sum(self.errors.values()) + self.verify_failures
        return f"requests={self.requests} hit={rate:.1%} errors={errors}"

    def count_engine_errors(self, stats: Mapping[str, Any]) -> None:
        """Count the failures the target's ``stats`` report: a failed or timed-out request
        is a miss to its caller, but it failed (a call made while a sidecar was unreachable
        is a plain miss)."""
        for name in ("failed_requests", "timed_out_requests"):
            if stats.get(name):
                self.errors[f"engine:{name}"] += int(stats[name])
        client = stats.get("client") or {}
        if client.get("timeouts"):
            self.errors["sidecar:timeouts"] += int(client["timeouts"])
