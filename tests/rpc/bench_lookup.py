"""Lookup round-trip latency over ipc for a long prompt, with 1 and 2 worker ranks.

Run: ``python tests/rpc/bench_lookup.py [--tokens 32768] [--rounds 2000]``. It starts the
workers (tests/rpc/lookup_worker.py, each holding the whole prompt), then times
``LookupClient.lookup`` and ``SyncLookupClient.lookup`` and prints p50/p99 in
milliseconds, as JSON lines. Each round asks about the same prompt (the scheduler asking
again about a waiting request) or, with ``--fresh``, about a new prompt every time; the
tokens are a list of int, or with ``--array`` an int32 ndarray (no conversion cost).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np

from lmcache_async.logging import configure_logging
from lmcache_async.rpc.lookup import LookupClient, SyncLookupClient

sys.path.insert(0, str(Path(__file__).parent))
from conftest import Launcher, prompt


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "p50_ms": round(statistics.median(ordered) * 1e3, 4),
        "p99_ms": round(ordered[int(len(ordered) * 0.99) - 1] * 1e3, 4),
        "mean_ms": round(statistics.fmean(ordered) * 1e3, 4),
    }


def prompts(args: argparse.Namespace) -> list[Any]:
    base = prompt(args.tokens)
    asked = [base]
    if args.fresh:
        asked = [[(t + i) % 50_000 for t in base] for i in range(1, args.rounds + 1)]
    if args.array:
        return [np.array(tokens, dtype=np.int32) for tokens in asked]
    return asked


async def time_async(args: argparse.Namespace, socket_dir: str, world: int) -> list[float]:
    samples = []
    asked = prompts(args)
    async with LookupClient("bench", world, socket_dir=socket_dir, timeout=5.0) as client:
        for _ in range(50):
            await client.lookup(asked[0])
        for i in range(args.rounds):
            tokens = asked[i % len(asked)]
            started = time.perf_counter()
            hits = await client.lookup(tokens)
            samples.append(time.perf_counter() - started)
            if not args.fresh and hits != args.tokens:
                raise SystemExit(f"expected {args.tokens} hits, got {hits}")
    return samples


def time_sync(args: argparse.Namespace, socket_dir: str, world: int) -> list[float]:
    samples = []
    asked = prompts(args)
    with SyncLookupClient("bench", world, socket_dir=socket_dir, timeout=5.0) as client:
        for _ in range(50):
            client.lookup(asked[0])
        for i in range(args.rounds):
            tokens = asked[i % len(asked)]
            started = time.perf_counter()
            client.lookup(tokens)
            samples.append(time.perf_counter() - started)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--fresh", action="store_true", help="a new prompt every round")
    parser.add_argument("--array", action="store_true", help="tokens as an int32 ndarray")
    args = parser.parse_args()
    configure_logging("WARNING", stream=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="lk") as directory:
        launcher = Launcher(Path(directory), Path(directory))
        try:
            workers = launcher(
                "bench",
                [(0, args.tokens), (1, args.tokens)],
                "--chunk-size",
                "256",
                "--cpu-gb",
                "0.05",
                prompt_len=args.tokens,
            )
            pids = [worker.process.pid for worker in workers]
            for world in (1, 2):
                for name in ("async", "sync"):
                    client_cpu = time.process_time()
                    server_cpu = [cpu_seconds(pid) for pid in pids[:world]]
                    if name == "async":
                        samples = anyio.run(time_async, args, directory, world)
                    else:
                        samples = time_sync(args, directory, world)
                    calls = args.rounds + 50
                    client_us = (time.process_time() - client_cpu) / calls * 1e6
                    server_us = [
                        (cpu_seconds(pid) - before) / calls * 1e6
                        for pid, before in zip(pids, server_cpu, strict=False)
                    ]
                    result = {
                        "client": name,
                        "ranks": world,
                        "tokens": args.tokens,
                        "fresh": args.fresh,
                        "array": args.array,
                        **percentiles(samples),
                        "client_cpu_us": round(client_us, 1),
                        "server_cpu_us": [round(us, 1) for us in server_us],
                    }
                    print(json.dumps(result), flush=True)
        finally:
            launcher.stop_all()


if __name__ == "__main__":
    main()
