"""A whole shared-Redis run: a throwaway ``redis-server``; host A (a sidecar and a
``vllm serve`` with the connector) and host B (the same, its RAM tier empty), both
sidecars in front of that Redis; each phase of :data:`~.options.PHASES` sends every prompt
one at a time, and each sidecar's counters are read around it."""

from __future__ import annotations

import contextlib
import json
import random
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, Final, TextIO

import anyio
import anyio.to_thread

from lmcache_async.bench.routing.bench import ROUTING_MODEL, kv_bytes_per_token
from lmcache_async.bench.routing.server import START_TIMEOUT, VllmServer, connector_config
from lmcache_async.bench.routing.workload import FIRST_TOKEN
from lmcache_async.bench.shared_redis.options import PHASES, SharedRedisOptions
from lmcache_async.bench.shared_redis.quiet import wait_idle
from lmcache_async.bench.shared_redis.report import Answer, counter_deltas, summarise
from lmcache_async.bench.shared_redis.sidecar import READY_TIMEOUT, SidecarProcess
from lmcache_async.bench.tiers.local import local_redis, tempfile_directory
from lmcache_async.bench.tiny_llama import build_tiny_llama
from lmcache_async.bench.vllm_target import check_vllm, read_model
from lmcache_async.errors import InvalidInputError

__all__ = ["MODEL", "REDIS_TIMEOUT", "run_shared_redis_bench"]

MODEL: Final = ROUTING_MODEL
"""The model built when none is given (the routing benchmark's: a 1k-token prefill costs
clearly more than a hit)."""

MODEL_NAME: Final = "shared"
"""The name both servers serve the model under (part of every cache key: both must match)."""

REQUEST_TIMEOUT: Final = 120.0
"""Seconds one request may take."""

REDIS_TIMEOUT: Final = 60.0
"""Seconds A's write-behind gets to put every chunk in Redis before B is asked."""

_START_LIMIT: Final = 3 * START_TIMEOUT + READY_TIMEOUT + 30.0
"""Seconds starting one host (its sidecar, then its server) may take in all."""

_VLLM_FLAGS: Final = ("--no-enable-prefix-caching",)
"""vLLM's own prefix cache off: a repeated prompt's hit is the connector's, from the host's
sidecar, never vLLM's KV cache."""


def _say(stream: TextIO | None, text: str) -> None:
    if stream is not None:
        print(f"bench: {text}", file=stream, flush=True)


def make_prompts(options: SharedRedisOptions, vocab_size: int) -> list[list[int]]:
    """The warm-up prompt and then ``prefixes`` more, each of random tokens (seeded)."""
    return _random_prompts(options, vocab_size, options.prefixes + 1, "")


def make_warmups(options: SharedRedisOptions, vocab_size: int, host: str) -> list[list[int]]:
    """``host``'s own warm-up prompts (seeded; none shares a chunk with another's)."""
    return _random_prompts(options, vocab_size, options.warmup_prompts, f"-warmup-{host}")


def _random_prompts(
    options: SharedRedisOptions, vocab_size: int, count: int, kind: str
) -> list[list[int]]:
    rng = random.Random(f"shared-redis-{options.seed}{kind}")
    return [
        [rng.randrange(FIRST_TOKEN, vocab_size) for _ in range(options.prompt_tokens)]
        for _ in range(count)
    ]


@contextlib.contextmanager
def _work_dir(path: str | None) -> Iterator[Path]:
    """``path`` (made if missing), or a temporary directory removed afterwards."""
    if path is not None:
        Path(path).mkdir(parents=True, exist_ok=True)
        yield Path(path)
        return
    with tempfile_directory() as scratch:
        yield Path(scratch)


def _model(directory: Path) -> str:
    """:data:`MODEL` in ``directory``: built unless an earlier run built it there."""
    with contextlib.suppress(OSError, ValueError):
        spec = json.loads((directory / "tiny_llama_spec.json").read_text(encoding="utf-8"))
        if spec == asdict(MODEL):
            return str(directory)
    return build_tiny_llama(str(directory), MODEL)


class _Host:
    """One host: its sidecar and its vLLM server, started and stopped together."""

    def __init__(
        self, name: str, directory: Path, options: SharedRedisOptions, model: str, **sidecar: Any
    ) -> None:
        self.sidecar = SidecarProcess(
            directory, f"sidecar-{name}", chunk_size=options.chunk_size, **sidecar
        )
        extra = {"sidecar_url": self.sidecar.url, "chunk_size": options.chunk_size}
        self.server = VllmServer(
            model,
            directory / f"vllm-{name}.log",
            model_name=MODEL_NAME,
            block_size=options.block_size,
            num_blocks=options.vllm_blocks,
            max_model_len=options.max_model_len,
            kv_transfer=connector_config(extra),
            extra_args=_VLLM_FLAGS,
        )

    def start(self) -> None:
        self.sidecar.start()
        self.server.start()

    def stop(self) -> None:
        try:
            self.server.stop()
        finally:
            self.sidecar.stop()


async def run_shared_redis_bench(
    options: SharedRedisOptions, *, progress_stream: TextIO | None = sys.stderr
) -> dict[str, Any]:
    """Run every phase and return every figure as plain data
    (:func:`~lmcache_async.bench.shared_redis.report.summarise`).

    Raises:
        InvalidInputError: the options are invalid, vLLM is not installed, or the model is
            unusable or too short for the prompts.
        ServerError: a server or a sidecar failed (the message quotes its log).
        TimeoutError: a request or a start took too long.
    """
    options.validate()
    check_vllm()
    with _work_dir(options.work_dir) as work:
        model = options.model
        if model is None:
            _say(progress_stream, "building the model")
            model = await anyio.to_thread.run_sync(_model, work / "model")
        info = read_model(model)
        if info.max_positions is not None and options.max_model_len > info.max_positions:
            raise InvalidInputError(
                f"prompts of {options.prompt_tokens} tokens do not fit the model's "
                f"{info.max_positions} positions"
            )
        prompts = make_prompts(options, info.vocab_size)
        cpu_gb = options.cpu_tier_gb(kv_bytes_per_token(model))
        with local_redis(str(work)) as redis_url:
            hosts = {
                name: _Host(name, work / name, options, model, redis_url=redis_url, cpu_gb=cpu_gb)
                for name in ("a", "b")
            }
            try:
                _say(progress_stream, "starting two hosts (a sidecar and vllm serve each)")
                async with anyio.create_task_group() as group:
                    for host in hosts.values():
                        group.start_soon(_in_thread, host.start, _START_LIMIT)
                for name, host in hosts.items():
                    warmups = make_warmups(options, info.vocab_size, name)
                    _say(
                        progress_stream, f"warming {name.upper()} up: {len(warmups)} prompts, twice"
                    )
                    await _warm_up(host, warmups, options)
                return await _phases(options, hosts, prompts, redis_url, progress_stream)
            finally:
                for host in hosts.values():
                    host.stop()


async def _warm_up(
    host: _Host, prompts: Sequence[Sequence[int]], options: SharedRedisOptions
) -> None:
    """``prompts`` to ``host`` twice: computed, then hits in its RAM; nothing kept."""
    for _ in range(2):
        await _send(host.server, prompts, options.max_tokens)


async def _phases(
    options: SharedRedisOptions,
    hosts: Mapping[str, _Host],
    prompts: Sequence[Sequence[int]],
    redis_url: str,
    stream: TextIO | None,
) -> dict[str, Any]:
    a, b = hosts["a"], hosts["b"]
    answers: dict[str, list[Answer]] = {}
    counters: dict[str, dict[str, float]] = {}
    redis_wait = 0.0
    redis_keys = 0
    idle: dict[str, float] = {}
    for phase in PHASES:
        host = a if phase.startswith("a-") else b
        if phase == "b-redis":
            _say(stream, "waiting for A's writes to reach Redis")
            redis_wait, redis_keys = await _await_redis(
                [a.sidecar, b.sidecar], redis_url, options.redis_chunks
            )
        idle[phase] = await wait_idle(lambda: _pids(hosts.values()))
        _say(stream, f"{phase}: {len(prompts) - 1} prompts (+1 warm-up) to {phase[0].upper()}")
        before = await host.sidecar.metrics()
        answers[phase] = (await _send(host.server, prompts, options.max_tokens))[1:]
        counters[phase] = counter_deltas(before, await host.sidecar.metrics())
    return summarise(
        options,
        answers,
        counters,
        redis_wait_s=redis_wait,
        redis_keys=redis_keys,
        idle_wait_s=idle,
    )


def _pids(hosts: Iterable[_Host]) -> list[int]:
    """The running sidecars' and servers' process ids."""
    pids = (pid for host in hosts for pid in (host.sidecar.pid, host.server.pid))
    return [pid for pid in pids if pid is not None]


async def _send(
    server: VllmServer, prompts: Sequence[Sequence[int]], max_tokens: int
) -> list[Answer]:
    """Each prompt one at a time, its answer numbered by its place in ``prompts``."""
    answers: list[Answer] = []
    for number, prompt in enumerate(prompts):
        with anyio.fail_after(REQUEST_TIMEOUT):
            got = await server.first_token(prompt, max_tokens=max_tokens, token_ids=True)
        answers.append(
            Answer(number, got.seconds, got.prompt_tokens, got.cached_tokens, got.token_ids)
        )
    return answers


async def _await_redis(
    sidecars: Sequence[SidecarProcess], redis_url: str, chunks: int
) -> tuple[float, int]:
    """Wait until no sidecar has a slow-tier write queued and Redis holds at least
    ``chunks`` keys; return the seconds waited and the keys. After :data:`REDIS_TIMEOUT`
    seconds, what is there is returned (the report shows B's misses)."""
    import redis.asyncio  # noqa: PLC0415

    began = time.perf_counter()
    client = redis.asyncio.Redis.from_url(redis_url)
    try:
        keys = 0
        with anyio.move_on_after(REDIS_TIMEOUT):
            while True:
                pending = 0.0
                for sidecar in sidecars:
                    metrics = await sidecar.metrics()
                    pending += metrics.get("lmcache_async_tier_writes_pending", 0.0)
                keys = int(await client.dbsize())
                if not pending and keys >= chunks:
                    break
                await anyio.sleep(0.05)
    finally:
        await client.aclose()
    return time.perf_counter() - began, keys


async def _in_thread(function: Callable[[], object], seconds: float) -> None:
    with anyio.fail_after(seconds):
        await anyio.to_thread.run_sync(function)
