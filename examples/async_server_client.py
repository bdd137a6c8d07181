"""A client of ``examples/async_server.py`` that checks what the server promises.

Without ``--url`` it starts the server as a child process on a free loopback port (any
other flags go to the server) and stops it at the end with SIGTERM, which closes the
server's engine in its lifespan. Against the server it:

1. sends a first request, ``prefix + suffix 0``, whose prompt the server stores;
2. sends ``--concurrency`` requests ``prefix + suffix i`` at once, each twice: with the cache
   (the prefix's whole chunks come from it) and with ``"cache": false``, and checks that
   both generate the same tokens (greedy decoding, bit-identical logits);
3. leaves one request after its first token and checks, in ``GET /stats``, that the server
   cancelled it and holds no pin.

Exit status 0 when every check passed::

    python examples/async_server_client.py [--prefix 512] [--concurrency 4] [--threads 1]
    python examples/async_server_client.py --url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import anyio
import httpx
import torch
from anyio.streams.buffered import BufferedByteReceiveStream

SERVER = Path(__file__).with_name("async_server.py")
TIMEOUT = 60.0


async def stream(
    client: httpx.AsyncClient,
    prompt: list[int],
    max_tokens: int,
    *,
    cache: bool = True,
    leave_after: int | None = None,
) -> tuple[int, list[int]]:
    """POST /generate and read its events: (prompt tokens from the cache, tokens).
    ``leave_after``: close the response after that many tokens, dropping the connection."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "cache": cache}
    cached, tokens, event = -1, [], ""
    async with client.stream("POST", "/generate", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("event: "):
                event = line.removeprefix("event: ")
            elif line.startswith("data: ") and event == "prefill":
                cached = json.loads(line.removeprefix("data: "))["cached_tokens"]
            elif line.startswith("data: ") and event == "token":
                tokens.append(json.loads(line.removeprefix("data: "))["token"])
                if len(tokens) == leave_after:
                    break
    return cached, tokens


async def check(client: httpx.AsyncClient, args: argparse.Namespace) -> bool:
    model = (await client.get("/model")).json()
    chunk, gen = model["chunk_size"], torch.Generator()
    gen.seed()  # prompts this server has not seen, if it ran before

    def prompt(length: int) -> list[int]:
        return torch.randint(0, model["vocab_size"], (length,), generator=gen).tolist()

    prefix, n = prompt(args.prefix), args.concurrency
    first, _ = await stream(client, prefix + prompt(16), 4)
    print(f"first request: {args.prefix + 16} prompt tokens, {first} from the cache")
    prompts = [prefix + prompt(16) for _ in range(n)]
    results: dict[tuple[int, bool], tuple[int, list[int]]] = {}

    async def one(i: int, cache: bool) -> None:
        results[i, cache] = await stream(client, prompts[i], 16, cache=cache)

    async with anyio.create_task_group() as group:
        for i in range(n):
            for cache in (True, False):
                group.start_soon(one, i, cache)
    reused = [results[i, True][0] for i in range(n)]
    same = sum(results[i, True][1] == results[i, False][1] for i in range(n))
    print(f"{n} concurrent requests: {reused} prompt tokens from the cache")
    print(f"tokens generated with the cache equal to those without: {same} of {n}")
    before = (await client.get("/stats")).json()["cancelled_requests"]
    await stream(client, prefix + prompt(16), 1000, leave_after=1)
    with anyio.fail_after(TIMEOUT):  # the server notices the disconnect, then unwinds
        while (stats := (await client.get("/stats")).json())["active_requests"]:  # noqa: ASYNC110
            await anyio.sleep(0.05)
    cancelled = stats["cancelled_requests"] - before
    print(
        f"client left mid-stream: {cancelled} request cancelled, "
        f"{stats['pinned_chunks']} chunks pinned, {stats['open_lookups']} lookups open"
    )
    pins = (stats["pinned_chunks"], stats["open_lookups"], stats["pool_pinned_objects"])
    expected = [args.prefix // chunk * chunk] * n
    return first == 0 and reused == expected and same == n and (cancelled, *pins) == (1, 0, 0, 0)


async def run(args: argparse.Namespace, server_args: list[str]) -> int:
    if args.url is not None:
        async with httpx.AsyncClient(base_url=args.url, timeout=TIMEOUT) as client:
            return 0 if await check(client, args) else 1
    command = [sys.executable, str(SERVER), "--port", "0", *server_args]
    server = await anyio.open_process(command, stdout=subprocess.PIPE, stderr=None)
    assert server.stdout is not None
    lines = BufferedByteReceiveStream(server.stdout)
    ok, last = False, b""
    try:
        with anyio.fail_after(TIMEOUT):
            url = (await lines.receive_until(b"\n", 4096)).decode().split()[-1]
        print(f"server: {url}")
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            ok = await check(client, args)
        server.terminate()  # SIGTERM: uvicorn shuts down, the lifespan closes the engine
        with anyio.fail_after(TIMEOUT):
            last = await lines.receive_until(b"\n", 4096)
            await server.wait()
    finally:
        if server.returncode is None:
            server.kill()
        with anyio.CancelScope(shield=True), anyio.move_on_after(5):
            await server.aclose()
    print(last.decode())
    return 0 if ok and last == b"server: engine closed" else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="a running server (default: start one)")
    parser.add_argument("--prefix", type=int, default=512, help="shared prefix tokens")
    parser.add_argument("--concurrency", type=int, default=4)
    args, server_args = parser.parse_known_args(argv)
    return anyio.run(run, args, server_args)


if __name__ == "__main__":
    sys.exit(main())
