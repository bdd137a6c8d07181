"""Prefix reuse with HuggingFace transformers: time to first token with and without the cache.

Builds a small random-weight Llama from a ``LlamaConfig`` (nothing is downloaded; float32,
eager attention), opens an embedded :class:`~lmcache_async.CacheEngine`, and:

1. prefills a first request, ``prefix + suffix 0``, and stores its KV;
2. for each repeat, takes a new request ``prefix + suffix i`` and prefills it twice: from
   scratch (no cache), and with the prefix's KV loaded from the cache so that only the
   suffix is computed;
3. prints both times to first token (medians) and checks the logits of the tokens both
   runs computed are bit-identical (``torch.equal``).

Exit status 0 when every comparison matched and the prefix was reused, 1 otherwise::

    python examples/transformers_prefix_reuse.py [--layers 4] [--prefix 1024] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import anyio
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from lmcache_async import CacheEngine, EngineConfig
from lmcache_async.integrations.transformers import kv_layout_for, prefill


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=1408)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--prefix", type=int, default=1024, help="shared prefix tokens")
    parser.add_argument("--suffix", type=int, default=64, help="new tokens per request")
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3, help="timed requests")
    parser.add_argument("--attn", choices=("eager", "sdpa"), default="eager")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def build_model(args: argparse.Namespace) -> LlamaForCausalLM:
    """A random-weight Llama in float32 (deterministic for a seed)."""
    settings: dict[str, Any] = {
        "vocab_size": args.vocab,
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "max_position_embeddings": max(4096, args.prefix + 2 * args.suffix),
        # Eager attention: the prefill of the suffix alone runs the very same kernels as
        # the full prefill, so the logits can be compared bit for bit.
        "attn_implementation": args.attn,
    }
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(LlamaConfig(**settings))  # type: ignore[no-untyped-call]
    model.eval()  # type: ignore[no-untyped-call]
    return model


def full_prefill(model: LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """Logits ``[1, T, vocab]`` of a prefill from scratch."""
    with torch.inference_mode():
        out = model(input_ids=ids.unsqueeze(0), past_key_values=DynamicCache(), use_cache=True)
    logits: torch.Tensor = out.logits
    return logits


async def run(args: argparse.Namespace) -> int:
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    model = build_model(args)
    layout = kv_layout_for(model.config, torch.float32)
    gen = torch.Generator().manual_seed(args.seed + 1)

    def random_tokens(n: int) -> torch.Tensor:
        return torch.randint(0, args.vocab, (n,), generator=gen, dtype=torch.int64)

    prefix = random_tokens(args.prefix)
    # One untimed pass first: the first forward pays for allocator and kernel warm-up.
    full_prefill(model, random_tokens(args.prefix + args.suffix))
    config = EngineConfig(chunk_size=args.chunk_size, max_local_cpu_size=0.5)
    cached_prefix = (args.prefix // args.chunk_size) * args.chunk_size
    uncached_s: list[float] = []
    cached_s: list[float] = []
    mismatches = 0
    reused: list[int] = []
    async with CacheEngine.open(config, layout, model_name="transformers-example") as engine:
        first_ids = torch.cat([prefix, random_tokens(args.suffix)])
        first = await prefill(model, first_ids, engine, layout)
        print(
            f"stored request 0: {args.prefix + args.suffix} tokens, "
            f"{first.stored_tokens} cached (chunk {args.chunk_size})"
        )
        for i in range(1, args.repeats + 1):
            ids = torch.cat([prefix, random_tokens(args.suffix)])
            t0 = time.perf_counter()
            full = await anyio.to_thread.run_sync(full_prefill, model, ids)
            uncached_s.append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            result = await prefill(model, ids, engine, layout, store=False)
            cached_s.append(time.perf_counter() - t0)

            reused.append(result.reused_tokens)
            same = torch.equal(full[:, result.reused_tokens :], result.logits)
            mismatches += not same
            print(
                f"request {i}: reused {result.reused_tokens} of {ids.numel()} tokens, "
                f"logits {'identical' if same else 'DIFFER'}"
            )

    uncached = statistics.median(uncached_s)
    cached = statistics.median(cached_s)
    print(
        f"model: {args.layers} layers, hidden {args.hidden}, {args.heads} heads "
        f"({args.kv_heads} kv), float32, {args.attn} attention"
    )
    print(f"prompt: {args.prefix} prefix + {args.suffix} new tokens")
    print(f"TTFT without cache: {uncached * 1e3:.1f} ms (median of {len(uncached_s)})")
    print(f"TTFT with cache:    {cached * 1e3:.1f} ms (median of {len(cached_s)})")
    print(f"speedup: {uncached / cached:.2f}x")
    ok = mismatches == 0 and all(n == cached_prefix for n in reused)
    print(f"logits match: {'yes (bit-exact)' if mismatches == 0 else 'NO'}")
    if not all(n == cached_prefix for n in reused):
        print(f"expected {cached_prefix} reused tokens per request, got {reused}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return anyio.run(run, args)


if __name__ == "__main__":
    sys.exit(main())
