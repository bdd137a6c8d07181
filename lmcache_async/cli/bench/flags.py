"""The flags of ``lmcache-async bench``, grouped as its help prints them."""

from __future__ import annotations

import argparse
from typing import Any

from lmcache_async.cli.bench.redis_flags import add_redis_flags

__all__ = ["add_bench_parser"]


def add_bench_parser(sub: Any) -> None:
    """Add ``bench`` and its flags to the subcommands ``sub``."""
    # Imported here so that ``check-config`` does not pay for torch.
    from lmcache_async.bench.loadgen import LoadOptions  # noqa: PLC0415

    emb = LoadOptions()
    bench = sub.add_parser(
        "bench",
        help="run the load generator (or --micro)",
        description="A workload (multi-round chat, long-document QA or random prompts) "
        "against an embedded engine or a sidecar, with real KV tensors, or against vLLM with "
        "the connector (time to first token); or with --micro the copy/lookup/hashing "
        "micro-benchmarks.",
    )
    _add_mode_flags(bench)
    bench.add_argument("--config", metavar="FILE.yaml", help="engine configuration file")
    bench.add_argument("--seed", type=int, default=emb.seed)
    bench.add_argument("--json", metavar="PATH", help="write every figure to PATH as JSON")
    bench.add_argument("--quiet", action="store_true", help="no progress and no summary")
    bench.add_argument("--plot", metavar="PATH.png", help="draw latency and hit rate over time")
    _add_shape_flags(bench.add_argument_group("model shape"), emb)
    _add_load_flags(bench.add_argument_group("load run"), emb)
    _add_vllm_flags(bench.add_argument_group("vLLM target (--target vllm)"), emb)
    _add_vllm_bench_flags(bench)
    _add_tier_bench_flags(bench)
    _add_trace_flags(bench)
    add_redis_flags(bench)


def _add_mode_flags(bench: Any) -> None:
    """The flags that choose a benchmark other than the load generator."""
    bench.add_argument("--micro", action="store_true", help="run the micro-benchmarks")
    bench.add_argument(
        "--tiers",
        action="store_true",
        help="disk and Redis put/get GB/s next to raw file and redis-py I/O of the same bytes",
    )
    bench.add_argument(
        "--sidecar",
        action="store_true",
        help="store/retrieve GB/s through a sidecar next to in-process, lookup round trips",
    )
    bench.add_argument(
        "--curve",
        action="store_true",
        help="--sidecar: also run the work through a sidecar under CURVE with an allow-list, "
        "beside the plain one",
    )
    bench.add_argument(
        "--gpu",
        action="store_true",
        help="store/retrieve D2H and H2D GB/s with KV caches on the GPU next to a plain pinned "
        "copy_, and layerwise retrieve overlapped with a simulated compute",
    )
    bench.add_argument(
        "--vllm-slow-tier",
        action="store_true",
        help="vLLM with a prompt only Redis holds behind a slow link: time to first token of "
        "the cost model next to loading everything, recomputing everything and no connector; "
        "another request's decode steps during a slow load next to its steps before",
    )
    bench.add_argument(
        "--routing",
        action="store_true",
        help="two vLLM servers, each with its own CPU tier, behind a KV-aware router (NVIDIA "
        "Dynamo's indexer): hit rate and time to first token of round robin, routing by "
        "vLLM's own KV events and routing by every tier's",
    )
    bench.add_argument(
        "--shared-redis",
        action="store_true",
        help="two hosts (a sidecar and vLLM each) sharing one Redis: time to first token of "
        "host B on prompts only host A saw (read from Redis) next to A's own warm hit",
    )
    bench.add_argument(
        "--scale",
        action="store_true",
        help="the CPU, disk and Redis tiers at growing N chunks: open time, time to a first "
        "RAM hit, the disk index next to a names-only walk, store/lookup/retrieve p50",
    )
    bench.add_argument(
        "--redis",
        action="store_true",
        help="8 x 3 MiB chunks only in Redis: the store and the retrieve embedded and through "
        "a sidecar next to a plain socket's SETs and GETs; a fresh engine's first store next "
        "to its steady state, pool prefault on and off",
    )
    bench.add_argument(
        "--redis-url",
        default=None,
        help="--tiers, --vllm-slow-tier, --redis: this Redis (default: start a redis-server)",
    )


def _add_shape_flags(shape: Any, emb: Any) -> None:
    """The model shape of the KV the benchmarks store, and the cache's size."""
    from lmcache_async.bench import DTYPES  # noqa: PLC0415

    shape.add_argument("--layers", type=int, default=emb.num_layers)
    shape.add_argument("--kv-heads", type=int, default=emb.num_kv_heads)
    shape.add_argument("--head-size", type=int, default=emb.head_size)
    shape.add_argument("--dtype", choices=tuple(DTYPES), default=emb.dtype)
    shape.add_argument("--block-size", type=int, default=emb.block_size)
    shape.add_argument(
        "--chunk-size", type=int, default=None, help="tokens per chunk (default: the config's)"
    )
    shape.add_argument(
        "--cache-gb",
        type=float,
        default=None,
        help="host cache size in GB (default: the config's max_local_cpu_size)",
    )


def _add_load_flags(load: Any, emb: Any) -> None:
    """The load generator's workload, target and pace."""
    from lmcache_async.bench.loadgen import ARRIVALS, TARGETS  # noqa: PLC0415
    from lmcache_async.bench.workloads import WORKLOADS  # noqa: PLC0415

    load.add_argument("--workload", choices=WORKLOADS, default=emb.workload)
    load.add_argument(
        "--target",
        choices=TARGETS,
        default=emb.target,
        help="embedded: an engine in this process; sidecar: lmcache-async serve at --url; "
        "vllm: vLLM on --model with the lmcache_async connector",
    )
    load.add_argument(
        "--url",
        default=None,
        help="the sidecar's ipc:// or tcp:// URL (with --target vllm: the connector's cache)",
    )
    load.add_argument("--model-name", default=emb.model_name, help="the cache namespace")
    load.add_argument("--duration", type=float, default=emb.duration, metavar="SECONDS")
    load.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help=f"in flight (default: {emb.concurrency}; with --trace: 1)",
    )
    load.add_argument(
        "--rate",
        type=float,
        default=emb.rate,
        metavar="REQ_PER_S",
        help="request arrival rate (0: as fast as --concurrency allows)",
    )
    load.add_argument("--arrival", choices=ARRIVALS, default=emb.arrival)
    load.add_argument("--users", type=int, default=emb.users, help="multi-round-chat")
    load.add_argument("--system-prompt-tokens", type=int, default=emb.system_prompt_tokens)
    load.add_argument("--turn-tokens", type=int, default=emb.turn_tokens)
    load.add_argument("--max-context-tokens", type=int, default=emb.max_context_tokens)
    load.add_argument("--documents", type=int, default=emb.documents, help="long-doc-qa")
    load.add_argument("--questions", type=int, default=emb.questions, help="per document")
    load.add_argument("--document-tokens", type=int, default=emb.document_tokens)
    load.add_argument("--question-tokens", type=int, default=emb.question_tokens)
    load.add_argument("--min-prompt-tokens", type=int, default=emb.min_prompt_tokens, help="random")
    load.add_argument("--max-prompt-tokens", type=int, default=emb.max_prompt_tokens, help="random")
    load.add_argument(
        "--verify-every",
        type=int,
        default=emb.verify_every,
        metavar="N",
        help="check every N-th retrieve bit for bit (0: never)",
    )
    load.add_argument(
        "--no-store-ahead",
        dest="store_ahead",
        action="store_false",
        help="--target sidecar: no STORE sent with each pinned lookup (store_ahead off)",
    )
    load.add_argument(
        "--beside-embedded",
        action="store_true",
        help="--trace --target sidecar: send each request also to an embedded engine of "
        "the same CPU tier, alternating which goes first, and print the two side by side "
        "with their ratios (one moment of the machine for both, not two runs)",
    )


def _add_vllm_flags(vllm: Any, emb: Any) -> None:
    """The vLLM server of ``--target vllm`` (and of the benchmarks that start vLLM)."""
    from lmcache_async.bench.vllm_target import VLLM_EXECUTORS  # noqa: PLC0415

    vllm.add_argument(
        "--model",
        default=None,
        metavar="DIR",
        help="a local Hugging Face model directory (nothing is downloaded); a small random one: "
        "python -m lmcache_async.bench.tiny_llama DIR",
    )
    vllm.add_argument(
        "--max-tokens", type=int, default=emb.max_tokens, help="tokens generated per request"
    )
    vllm.add_argument(
        "--kv-cache-gb", type=float, default=emb.kv_cache_gb, help="vLLM's paged KV memory (GiB)"
    )
    vllm.add_argument(
        "--vllm-dtype", default=emb.vllm_dtype, help="model dtype in vLLM (auto: the config's)"
    )
    vllm.add_argument(
        "--vllm-executor",
        choices=VLLM_EXECUTORS,
        default=emb.vllm_executor,
        help="mp: vLLM's worker in its own process (vLLM's default); uni: in the engine core "
        "process (starts faster)",
    )
    vllm.add_argument(
        "--no-connector",
        action="store_true",
        help="plain vLLM without the cache: a baseline time to first token",
    )


def _add_vllm_bench_flags(bench: Any) -> None:
    """The settings of the benchmarks that run vLLM servers: slow tier, routing, shared Redis."""
    from lmcache_async.bench.routing.options import RoutingOptions  # noqa: PLC0415
    from lmcache_async.bench.shared_redis.options import SharedRedisOptions  # noqa: PLC0415
    from lmcache_async.bench.slow_tier.options import SlowTierOptions  # noqa: PLC0415

    sto = SlowTierOptions()
    rto = RoutingOptions()
    sro = SharedRedisOptions()
    slow = bench.add_argument_group(
        "vLLM with a slow Redis tier (--vllm-slow-tier; also takes --model, --chunk-size)"
    )
    slow.add_argument("--rounds", type=int, default=sto.rounds, help="time-to-first-token rounds")
    slow.add_argument(
        "--link-mb-per-s",
        type=float,
        default=sto.link_bytes_per_s / 1e6,
        help="the rate of the link between the connector and Redis (MB/s, each way)",
    )
    slow.add_argument(
        "--prompt-tokens", type=int, default=sto.prompt_tokens, help="tokens of each prompt"
    )

    routing = bench.add_argument_group(
        "KV-aware routing (--routing; also takes --model, --seed, --chunk-size)"
    )
    routing.add_argument(
        "--prefixes", type=int, default=rto.prefixes, help="shared prefixes the requests repeat"
    )
    routing.add_argument(
        "--prefix-tokens", type=int, default=rto.prefix_tokens, help="tokens of each prefix"
    )
    routing.add_argument(
        "--requests", type=int, default=rto.requests, help="requests of each policy, in turn"
    )
    routing.add_argument(
        "--vllm-cache-prefixes",
        type=int,
        default=None,
        help="prefixes vLLM's own KV cache holds (default: a quarter of --prefixes)",
    )
    routing.add_argument(
        "--cpu-tier-prefixes",
        type=int,
        default=None,
        help="prefixes each server's CPU tier holds (default: 60%% of --prefixes)",
    )
    routing.add_argument(
        "--work-dir",
        default=None,
        metavar="DIR",
        help="--routing: where the model and the servers' and indexers' logs go; --scale: "
        "where the disk directories go, kept and used again by a later run; --trace: where "
        "the disk tier's directory goes, removed after (default: a temporary directory, "
        "removed after)",
    )

    shared = bench.add_argument_group(
        "two hosts through Redis (--shared-redis; also takes --model, --seed, --chunk-size, "
        "--work-dir)"
    )
    shared.add_argument(
        "--shared-prefixes", type=int, default=sro.prefixes, help="prompts sent in each phase"
    )
    shared.add_argument(
        "--shared-prefix-tokens",
        type=int,
        default=sro.prefix_tokens,
        help="cached tokens of each prompt (whole chunks)",
    )
    shared.add_argument(
        "--shared-max-tokens",
        type=int,
        default=sro.max_tokens,
        help="tokens generated per request (A's warm and B's are compared)",
    )


def _add_tier_bench_flags(bench: Any) -> None:
    """The settings of the benchmarks of the engine alone: scale, micro, GPU."""
    from lmcache_async.bench.micro import MicroOptions  # noqa: PLC0415
    from lmcache_async.bench.scale.options import TIERS, ScaleOptions  # noqa: PLC0415

    mic = MicroOptions()
    sco = ScaleOptions()
    scale = bench.add_argument_group("tiers at growing N (--scale; also takes --work-dir, --seed)")
    scale.add_argument(
        "--scale-sizes",
        default=",".join(map(str, sco.sizes)),
        metavar="N,N,...",
        help="chunks each tier holds, one size after the other (10k: ten thousand)",
    )
    scale.add_argument(
        "--scale-tiers", default=",".join(sco.tiers), metavar="TIER,...", help=f"of {TIERS}"
    )
    scale.add_argument(
        "--scale-requests", type=int, default=sco.requests, help="requests timed at each size"
    )

    micro = bench.add_argument_group("micro-benchmarks (--micro)")
    micro.add_argument("--tokens", type=int, default=mic.tokens, help="tokens per copy")
    micro.add_argument("--lookup-tokens", type=int, default=mic.lookup_tokens)
    micro.add_argument("--repeat", type=int, default=mic.repeat, help="measured copy runs")

    gpu = bench.add_argument_group("GPU benchmark (--gpu; also takes --tokens and --repeat)")
    gpu.add_argument(
        "--device",
        default="auto",
        help="auto (CUDA when available, else the CPU path), cuda, cuda:N or cpu",
    )


def _tokens(text: str) -> int:
    """A token count as ``--trace-cpu-tokens`` takes it: ``3000000``, ``3M``, ``512k``."""
    from lmcache_async.bench.trace import parse_capacities  # noqa: PLC0415
    from lmcache_async.errors import InvalidInputError  # noqa: PLC0415

    try:
        (tokens,) = parse_capacities(text)
    except (InvalidInputError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"a number of tokens (3M, 512k), got {text!r}") from exc
    return tokens


def _add_trace_flags(bench: Any) -> None:
    """The trace replay's settings (``--trace``) and its synthetic trace (``--trace-generate``)."""
    from lmcache_async.bench.trace import DEFAULT_BLOCK_SIZE  # noqa: PLC0415

    bench.add_argument(
        "--trace",
        metavar="FILE.jsonl",
        default=None,
        help="replay a trace in Mooncake's JSONL format (timestamp, input_length, "
        "output_length, hash_ids) against --target, beside its unbounded and block-LRU hit rates",
    )
    bench.add_argument(
        "--trace-generate",
        metavar="PATH.jsonl",
        default=None,
        help="write a synthetic trace (shared system prompts, multi-turn sessions, one-off "
        "prompts) to PATH, then replay it if --trace names it too",
    )
    trace = bench.add_argument_group(
        "trace replay (--trace; also takes --target, --url, --concurrency, --seed, the model "
        "shape, --verify-every, --max-tokens, --cache-gb, --work-dir, --plot)"
    )
    trace.add_argument(
        "--trace-block-size",
        type=int,
        default=DEFAULT_BLOCK_SIZE,
        help="tokens per hash id, and the engine's chunk size",
    )
    trace.add_argument("--limit", type=int, default=None, help="replay the first N requests")
    trace.add_argument(
        "--speed",
        type=float,
        default=None,
        metavar="X",
        help="send each request at its timestamp, X times real time (default: closed loop)",
    )
    trace.add_argument(
        "--trace-cpu-tokens",
        type=_tokens,
        default=None,
        metavar="N",
        help="a CPU tier of N tokens (default: --cache-gb or the config's; with a disk tier, "
        "room for the prompts in flight and one more)",
    )
    trace.add_argument(
        "--trace-disk-tokens",
        type=_tokens,
        default=None,
        metavar="N",
        help="a disk tier of N tokens behind the CPU tier, written through; the LRU bound is "
        "at its capacity",
    )
    trace.add_argument(
        "--capacities",
        default=None,
        metavar="TOKENS,...",
        help="sweep the CPU tier's (with a disk tier: the disk tier's) capacity, e.g. "
        "0.5M,1M,3M,10M: the block LRU's hit rate and the bytes of each",
    )
    trace.add_argument(
        "--sweep-replay",
        action="store_true",
        help="--capacities: replay the trace at each capacity too (slow: one replay each)",
    )
    trace.add_argument(
        "--trace-vocab",
        type=int,
        default=None,
        metavar="N",
        help="token ids below N (default: 32000, or the model's vocabulary for --target vllm)",
    )
    trace.add_argument(
        "--trace-requests",
        type=int,
        default=3000,
        metavar="N",
        help="--trace-generate: requests in the synthetic trace",
    )
