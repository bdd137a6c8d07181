"""An async HTTP server (FastAPI + uvicorn) that prefills through the cache and streams tokens.

Serves a small random-weight Llama built from a ``LlamaConfig`` (nothing is downloaded). One
:class:`~lmcache_async.CacheEngine`, opened in the app's lifespan and closed on shutdown,
serves every request. ``POST /generate`` takes token ids, prefills them with
``lmcache_async.integrations.transformers.prefill`` (the cached prefix is loaded, the rest
computed, the prompt stored), decodes greedily and streams server-sent events: ``prefill``
(prompt tokens, and how many came from the cache), one ``token`` per token, then ``done``;
``"cache": false`` computes the whole prompt instead. The model runs in worker threads
(``anyio.to_thread``), so the event loop goes on serving the other requests meanwhile. A
client that leaves mid-stream cancels its request; ``GET /stats`` shows what is pinned::

    python examples/async_server.py --port 8000      # --port 0: any free port
    curl -N localhost:8000/generate -H 'Content-Type: application/json' \
        -d '{"prompt": [5, 6, 7, 8], "max_tokens": 4}'

``examples/async_server_client.py`` starts it and checks it (needs fastapi, uvicorn, httpx:
``pip install -e '.[examples]'``).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.to_thread
import torch
import uvicorn
from fastapi import FastAPI, HTTPException
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from lmcache_async import CacheEngine, EngineConfig
from lmcache_async.integrations.transformers import kv_layout_for, prefill


class GenerateRequest(BaseModel):
    prompt: list[int] = Field(min_length=1, max_length=2048)
    max_tokens: int = Field(16, ge=1, le=1024)
    cache: bool = True


def sse(event: str, data: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"


def create_app(args: argparse.Namespace) -> FastAPI:
    torch.manual_seed(args.seed)
    settings = LlamaConfig(  # type: ignore[call-arg]  # attn_implementation
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        attn_implementation="eager",  # the same kernels with and without a cached prefix
    )
    model = LlamaForCausalLM(settings).eval()  # type: ignore[no-untyped-call]
    layout = kv_layout_for(model.config, torch.float32)
    counts = {"active_requests": 0, "cancelled_requests": 0}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        config = EngineConfig(chunk_size=args.chunk_size, max_local_cpu_size=0.25)
        async with CacheEngine.open(config, layout, model_name="async-server") as engine:
            app.state.engine = engine
            yield
        print("server: engine closed", flush=True)

    app = FastAPI(lifespan=lifespan)

    def forward(ids: torch.Tensor, cache: DynamicCache) -> Any:
        with torch.inference_mode():  # thread-local: entered in the worker thread
            return model(input_ids=ids.view(1, -1), past_key_values=cache, use_cache=True)

    async def events(request: GenerateRequest, engine: CacheEngine) -> AsyncIterator[str]:
        ids = torch.tensor(request.prompt, dtype=torch.int64)
        counts["active_requests"] += 1
        try:
            if request.cache:
                out: Any = await prefill(model, ids, engine, layout)
                cached = out.reused_tokens
            else:
                out, cached = await anyio.to_thread.run_sync(forward, ids, DynamicCache()), 0
            yield sse("prefill", {"prompt_tokens": ids.numel(), "cached_tokens": cached})
            past = out.past_key_values
            token = int(out.logits[0, -1].argmax())
            for i in range(request.max_tokens):
                yield sse("token", {"token": token})
                if i + 1 < request.max_tokens:
                    step = await anyio.to_thread.run_sync(forward, torch.tensor([token]), past)
                    token = int(step.logits[0, -1].argmax())
            yield sse("done", {"tokens": request.max_tokens})
        except (anyio.get_cancelled_exc_class(), GeneratorExit):
            counts["cancelled_requests"] += 1  # the client went away
            raise
        finally:
            counts["active_requests"] -= 1

    @app.post("/generate")
    async def generate(request: GenerateRequest) -> StreamingResponse:
        if min(request.prompt) < 0 or max(request.prompt) >= args.vocab:
            raise HTTPException(422, f"token ids must be in [0, {args.vocab})")
        return StreamingResponse(events(request, app.state.engine), media_type="text/event-stream")

    @app.get("/model")
    async def model_info() -> dict[str, int]:
        return {"vocab_size": args.vocab, "chunk_size": args.chunk_size}

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        engine_stats = app.state.engine.stats()
        return {
            **counts,
            "pinned_chunks": engine_stats.pinned_chunks,
            "open_lookups": engine_stats.active_lookup_ids,
            "pool_pinned_objects": engine_stats.pool.pinned_objects,
            "hit_rate": engine_stats.hit_rate,
        }

    return app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0: any free port")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--chunk-size", type=int, default=128)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    app = create_app(args)
    # Listening before the address is printed: a client may connect at once.
    sock = socket.create_server((args.host, args.port))
    print(f"serving on http://{args.host}:{sock.getsockname()[1]}", flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
