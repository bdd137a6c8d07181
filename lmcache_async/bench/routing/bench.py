"""A whole routing run: the model, then for each policy two fresh ``vllm serve`` with the
connector and one fresh Dynamo indexer subscribed to both, the workload sent one request
at a time through the policy's router, and the servers' hit counters."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import random
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, Final, NamedTuple, Protocol, TextIO

import anyio
import anyio.to_thread

from lmcache_async.bench.routing.indexer import DynamoIndexer, TierMatch
from lmcache_async.bench.routing.options import CacheSizes, RoutingOptions
from lmcache_async.bench.routing.policy import MatchSource, Router
from lmcache_async.bench.routing.report import PolicyRun, Served, summarise
from lmcache_async.bench.routing.server import (
    START_TIMEOUT,
    FirstToken,
    PrefixHits,
    VllmServer,
    connector_config,
)
from lmcache_async.bench.routing.workload import FIRST_TOKEN, Request, make_requests
from lmcache_async.bench.tiers.local import tempfile_directory
from lmcache_async.bench.tiny_llama import TinyLlamaSpec, build_tiny_llama
from lmcache_async.bench.vllm_target import check_vllm, read_model
from lmcache_async.errors import InvalidInputError

__all__ = [
    "ROUTING_MODEL",
    "WORKERS",
    "Completer",
    "drive",
    "kv_bytes_per_token",
    "run_routing_bench",
]

ROUTING_MODEL: Final = TinyLlamaSpec(
    layers=4, hidden=768, heads=12, kv_heads=4, head_dim=64, intermediate=2048
)
"""The model built when none is given: big enough that prefilling a 512-token prefix
(0.1-0.35 s on two idle cores) clearly costs more than a hit (tens of ms), so hits show in
the time to first token (on the default tiny Llama a miss takes 40-50 ms, a hit 25-30)."""

WORKERS: Final = (1, 2)
"""The servers' worker ids in the index."""

MODEL_NAME: Final = "routing"
"""The name the servers serve the model under, and the indexer indexes it under."""

REQUEST_TIMEOUT: Final = 120.0
"""Seconds one request may take, its routing included."""

SUBSCRIBE_TIMEOUT: Final = 60.0
"""Seconds for the indexer to show a probe prompt of each server (its subscription live)."""

_START_LIMIT: Final = 3 * START_TIMEOUT + 30.0
"""Seconds starting a server may take in all (up to three tries on taken ports)."""

_INDEXER_LIMIT: Final = 60.0
"""Seconds starting the indexer may take (it retries on taken ports)."""

_KV_BYTES: Final = 2
"""Bytes of one KV element in vLLM: a float32 model runs in bfloat16 (vLLM downcasts it),
a float16 or bfloat16 one as it is."""

_PROGRESS_EVERY: Final = 16
"""Requests between two progress lines."""


class Completer(Protocol):
    """What a request is sent to (a :class:`VllmServer`)."""

    async def first_token(self, tokens: Sequence[int], *, max_tokens: int = 1) -> FirstToken: ...


def _say(stream: TextIO | None, text: str) -> None:
    if stream is not None:
        print(f"bench: {text}", file=stream, flush=True)


async def drive(
    router: Router,
    index: MatchSource,
    servers: Mapping[int, Completer],
    requests: Sequence[Request],
    *,
    on_served: Callable[[int], None] | None = None,
    timeout: float = REQUEST_TIMEOUT,
) -> list[Served]:
    """Send ``requests`` one at a time, each where ``router`` chooses after reading
    ``index``; ``on_served`` is told how many are done after each.

    Raises:
        TimeoutError: a request (its routing included) took over ``timeout`` seconds.
        Exception: whatever the index or a server raises.
    """
    served: list[Served] = []
    for request in requests:
        with anyio.fail_after(timeout):
            worker, matches = await router.route(index, request.tokens)
            answer = await servers[worker].first_token(request.tokens)
        served.append(
            Served(
                request.prefix,
                worker,
                answer.seconds,
                answer.prompt_tokens,
                answer.cached_tokens,
                matches.get(worker, TierMatch()).cpu,
            )
        )
        if on_served is not None:
            on_served(len(served))
    return served


def kv_bytes_per_token(model_dir: str) -> int:
    """Bytes of KV one token takes in vLLM's cache (and in the connector's tier) for the
    model in ``model_dir``, from its ``config.json``.

    Raises:
        InvalidInputError: the config lacks the layer or head counts.
    """
    config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    config = config.get("text_config") or config
    try:
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidInputError(f"--model {model_dir}: config.json lacks {exc}") from None
    return 2 * layers * kv_heads * head_dim * _KV_BYTES


@contextlib.contextmanager
def _work_dir(path: str | None) -> Iterator[Path]:
    """``path`` (made if missing), or a temporary directory removed afterwards."""
    if path is not None:
        directory = Path(path)
        directory.mkdir(parents=True, exist_ok=True)
        yield directory
        return
    with tempfile_directory() as scratch:
        yield Path(scratch)


def _model(directory: Path) -> str:
    """The routing model in ``directory``: built unless an earlier run built it there."""
    spec_file = directory / "tiny_llama_spec.json"
    with contextlib.suppress(OSError, ValueError):
        if json.loads(spec_file.read_text(encoding="utf-8")) == asdict(ROUTING_MODEL):
            return str(directory)
    return build_tiny_llama(str(directory), ROUTING_MODEL)


async def run_routing_bench(
    options: RoutingOptions, *, progress_stream: TextIO | None = sys.stderr
) -> dict[str, Any]:
    """Run every policy of ``options`` on fresh servers and return every figure as plain
    data (:func:`~lmcache_async.bench.routing.report.summarise`). Progress goes to
    ``progress_stream`` (None: nowhere).

    Raises:
        InvalidInputError: the options are invalid, vLLM or Dynamo's indexer is not
            installed, or the model directory is unusable or too short for the prompts.
        ServerError, IndexerError: a server or the indexer failed (the message quotes its
            log).
        TimeoutError: a request or a start took too long.
    """
    options.validate()
    check_vllm()
    if importlib.util.find_spec("dynamo") is None:
        raise InvalidInputError(
            "--routing needs NVIDIA Dynamo's indexer: pip install 'lmcache-async[router]'"
        )
    with _work_dir(options.work_dir) as work:
        model = options.model
        if model is None:
            _say(progress_stream, "building the model")
            model = await anyio.to_thread.run_sync(_model, work / "model")
        info = read_model(model)
        sizes = options.sizes(kv_bytes_per_token(model))
        if info.max_positions is not None and sizes.max_model_len > info.max_positions:
            raise InvalidInputError(
                f"prompts of {options.prompt_tokens} tokens do not fit the model's "
                f"{info.max_positions} positions"
            )
        setup = _Setup(
            options, model, sizes, make_requests(options, info.vocab_size), info.vocab_size
        )
        runs: dict[str, PolicyRun] = {}
        for number, policy in enumerate(options.policies, 1):
            label = f"policy {number}/{len(options.policies)} {policy}"
            runs[policy] = await _run_policy(
                policy,
                setup,
                work / policy,
                say=functools.partial(_labelled, progress_stream, label),
            )
    return summarise(options, sizes, runs)


class _Setup(NamedTuple):
    """What every policy's run shares."""

    options: RoutingOptions
    model: str
    sizes: CacheSizes
    requests: Sequence[Request]
    vocab_size: int


def _labelled(stream: TextIO | None, label: str, text: str) -> None:
    _say(stream, f"{label}: {text}")


async def _run_policy(
    policy: str, setup: _Setup, directory: Path, *, say: Callable[[str], None]
) -> PolicyRun:
    """One policy on two fresh servers and a fresh indexer, all stopped on the way out."""
    options, sizes, requests = setup.options, setup.sizes, setup.requests
    extra = {
        "chunk_size": options.chunk_size,
        "max_local_cpu_size": sizes.cpu_tier_gb,
        # A request's unique end is shorter than a chunk: kept, it would only crowd out
        # prefixes. Only whole chunks, all of them prefix, are stored.
        "save_unfull_chunk": False,
    }
    servers = {
        worker: VllmServer(
            setup.model,
            directory / f"vllm-{worker}.log",
            model_name=MODEL_NAME,
            block_size=options.block_size,
            num_blocks=sizes.vllm_blocks,
            max_model_len=sizes.max_model_len,
            kv_transfer=connector_config(extra),
        )
        for worker in WORKERS
    }
    indexer: DynamoIndexer | None = None
    try:
        say("starting two vLLM servers")
        began = time.perf_counter()
        async with anyio.create_task_group() as group:
            for server in servers.values():
                group.start_soon(_in_thread, server.start, _START_LIMIT)
        startup = time.perf_counter() - began
        indexer = DynamoIndexer(
            directory / "indexer",
            block_size=options.block_size,
            model_name=MODEL_NAME,
            workers={worker: server.events_endpoint for worker, server in servers.items()},
        )
        await _in_thread(indexer.start, _INDEXER_LIMIT)
        await _await_subscribed(indexer, servers, options, setup.vocab_size)
        before = {worker: await server.prefix_hits() for worker, server in servers.items()}
        say(f"{len(requests)} requests, one at a time")

        def progress(done: int) -> None:
            if done % _PROGRESS_EVERY == 0 or done == len(requests):
                say(f"requests {done}/{len(requests)}")

        served = await drive(
            Router(policy, WORKERS), indexer, servers, requests, on_served=progress
        )
        load = _load_average()
        await anyio.sleep(0.5)  # the servers' counters catch up with the last request
        after = {worker: await server.prefix_hits() for worker, server in servers.items()}
    finally:
        if indexer is not None:
            indexer.stop()
        for server in servers.values():
            server.stop()
    hits = PrefixHits(
        sum(after[w].local - before[w].local for w in WORKERS),
        sum(after[w].external - before[w].external for w in WORKERS),
    )
    return PolicyRun(served, hits, startup, load)


def _load_average() -> float | None:
    """The machine's 1-minute load average (None where the platform has none)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


async def _in_thread(function: Callable[[], object], seconds: float) -> None:
    """Run blocking ``function`` (a start that polls its child) in a worker thread.

    Raises:
        TimeoutError: it took over ``seconds`` (reported once it returns: the thread is
            not interrupted, and the start bounds its own wait).
    """
    with anyio.fail_after(seconds):
        await anyio.to_thread.run_sync(function)


async def _await_subscribed(
    index: DynamoIndexer,
    servers: Mapping[int, VllmServer],
    options: RoutingOptions,
    vocab_size: int,
) -> None:
    """Send each server fresh one-block probes until the index shows one under it: its
    subscription is live (a ZMQ subscriber misses what was published before it joined).
    The probes also warm the servers up; a block and a token each, they leave at most a
    block in each cache (none in the CPU tier when a chunk is longer), the first evicted.

    Raises:
        TimeoutError: no probe showed within :data:`SUBSCRIBE_TIMEOUT` seconds.
    """
    rng = random.Random(f"probe-{options.seed}")
    for worker, server in servers.items():
        with anyio.fail_after(SUBSCRIBE_TIMEOUT):
            while True:
                probe = [
                    rng.randrange(FIRST_TOKEN, vocab_size) for _ in range(options.block_size + 1)
                ]
                await server.first_token(probe)
                if await _shows(index, probe, worker, options.block_size):
                    break


async def _shows(index: DynamoIndexer, probe: list[int], worker: int, tokens: int) -> bool:
    """Whether ``index`` shows ``tokens`` of ``probe`` under ``worker`` within 2 s."""
    for _ in range(40):
        if (await index.match(probe, worker)).gpu >= tokens:
            return True
        await anyio.sleep(0.05)
    return False
