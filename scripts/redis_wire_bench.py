"""The Redis tier's bulk path against a plain socket, in the same run.

Usage: ``python scripts/redis_wire_bench.py [--chunks 8] [--chunk-mib 3] [--rounds 10]
[--url redis://127.0.0.1:6379]`` (without ``--url`` a throwaway ``redis-server`` is
started on a free loopback port and stopped at the end).

Each round, in alternating order (each write starting just after the values before it
were deleted, so that the server's allocator is in the same state for both):

* ``tier_put``: :meth:`RedisBackend.put` of ``--chunks`` fresh chunks (random bytes,
  their checksums cleared, as for chunks written for the first time), including its
  ``EXISTS`` round trip; ``plain_set``: a blocking socket sending the very records the
  tier stored as ``SET`` commands, straight from memory (``sendmsg``), then reading the
  replies;
* ``tier_get``: :meth:`RedisBackend.get` of those chunks into pool objects (header and
  checksum checked), released after; ``plain_get``: the same ``GET`` s on a blocking
  socket, each value received (``recv_into``) into its own preallocated buffer.

Prints the medians (ms) and the ratios tier / plain (the median of each round's ratio),
as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from typing import Any

import anyio
import numpy as np
import torch

from lmcache_async.backends.codec import Codec
from lmcache_async.backends.record import RecordSpec
from lmcache_async.backends.redis import DEFAULT_KEY_PREFIX, RedisBackend
from lmcache_async.keys.chunks import DIGEST_SIZE, ChunkKey
from lmcache_async.memory.pool import MemoryObj, MemoryPool, page_size_for

WIDTH = 4096  # bf16 values per token row


def spec_for(chunk_bytes: int) -> RecordSpec:
    tokens = chunk_bytes // (WIDTH * 2)
    return RecordSpec(
        fingerprint=f"wire-bench;width={WIDTH}",
        fmt="KV_TD",
        dtype=torch.bfloat16,
        max_tokens=tokens,
        shape_of=lambda n: (n, WIDTH),
        codec=Codec.NONE,
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Plain:
    """A blocking socket doing what the tier does, nothing else."""

    def __init__(self, host: str, port: int) -> None:
        self.sock = socket.create_connection((host, port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.scratch = bytearray(64 * 1024)
        self.start = self.end = 0

    def line(self) -> bytes:
        while True:
            at = self.scratch.find(b"\r\n", self.start, self.end)
            if at >= 0:
                line = bytes(self.scratch[self.start : at])
                self.start = at + 2
                return line
            if self.start == self.end:
                self.start = self.end = 0
            self.end += self.sock.recv_into(memoryview(self.scratch)[self.end :])

    def read_into(self, dest: memoryview) -> None:
        take = min(len(dest), self.end - self.start)
        dest[:take] = self.scratch[self.start : self.start + take]
        self.start += take
        got = take
        while got < len(dest):
            got += self.sock.recv_into(dest[got:])

    def skip_crlf(self) -> None:
        while self.end - self.start < 2:
            if self.start == self.end:
                self.start = self.end = 0
            self.end += self.sock.recv_into(memoryview(self.scratch)[self.end :])
        self.start += 2

    def sets(self, keys: list[bytes], values: list[tuple[bytes, memoryview]]) -> None:
        for key, (header, payload) in zip(keys, values, strict=True):
            size = len(header) + len(payload)
            head = b"*4\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(key), key, size)
            parts = [memoryview(head + header), payload, memoryview(b"\r\n$2\r\nNX\r\n")]
            while parts:
                sent = self.sock.sendmsg(parts)
                while parts and sent >= len(parts[0]):
                    sent -= len(parts[0])
                    parts.pop(0)
                if parts:
                    parts[0] = parts[0][sent:]
        for _ in keys:
            self.line()

    def gets(self, keys: list[bytes], dests: list[memoryview]) -> None:
        self.sock.sendall(b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(k), k) for k in keys))
        for dest in dests:
            size = int(self.line()[1:])
            self.read_into(dest[:size])
            self.skip_crlf()

    def command(self, *args: bytes) -> bytes:
        self.sock.sendall(
            b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)
        )
        return self.line()


async def run(url: str, host: str, port: int, chunks: int, chunk_bytes: int, rounds: int) -> Any:
    spec = spec_for(chunk_bytes)
    pool = MemoryPool(
        4 * chunks * chunk_bytes + (16 << 20), page_size=page_size_for(chunk_bytes), pin_memory=False
    )
    tier = await RedisBackend.open(url, pool=pool, spec=spec, allocation_timeout=5.0, timeout=30.0)
    plain = Plain(host, port)
    shape = spec.shape_of(spec.max_tokens)
    objs: list[MemoryObj] = []
    for _ in range(chunks):
        obj = await pool.allocate(shape, spec.dtype, timeout=1)
        obj.tensor.view(torch.uint8).reshape(-1).copy_(
            torch.from_numpy(np.frombuffer(os.urandom(chunk_bytes), dtype=np.uint8))
        )
        objs.append(obj)
    dests = [memoryview(np.empty(chunk_bytes + 4096, dtype=np.uint8)).cast("B") for _ in objs]
    times: dict[str, list[float]] = {k: [] for k in ("tier_put", "plain_set", "tier_get", "plain_get")}
    try:
        for r in range(rounds):
            keys = [ChunkKey(os.urandom(DIGEST_SIZE)) for _ in objs]
            rkeys = [(DEFAULT_KEY_PREFIX + k.to_str()).encode() for k in keys]
            plain_keys = [b"plain:%d:%d" % (r, i) for i in range(chunks)]
            records = [spec.encode(k, o) for k, o in zip(keys, objs, strict=True)]
            values = [(h, memoryview(p).cast("B")) for h, p in records]
            for obj in objs:
                obj.checksum = None  # as for chunks written for the first time

            async def tier_put() -> None:
                assert await tier.put(keys, objs) == chunks

            def plain_set() -> None:
                plain.sets(plain_keys, values)

            async def tier_get() -> None:
                got = await tier.get(keys)
                assert all(g is not None for g in got)
                for g in got:
                    assert g is not None
                    g.unref()

            def plain_get() -> None:
                plain.gets(plain_keys, dests)

            # Each write starts with the server in the same state: the values before it
            # were just deleted (a server's allocator serves a write faster from memory
            # it has just freed than from fresh pages).
            writes = [("tier_put", tier_put, rkeys), ("plain_set", plain_set, plain_keys)]
            reads = [("tier_get", tier_get), ("plain_get", plain_get)]
            if r % 2:
                writes.reverse()
                reads.reverse()
            for name, fn, written in writes:
                began = time.perf_counter()
                result = fn()
                if result is not None:
                    await result
                times[name].append(time.perf_counter() - began)
                plain.command(b"DEL", *written)
            await tier.put(keys, objs)
            plain.sets(plain_keys, values)
            for name, read in reads:
                began = time.perf_counter()
                result = read()
                if result is not None:
                    await result
                times[name].append(time.perf_counter() - began)
            plain.command(b"DEL", *rkeys, *plain_keys)
    finally:
        for obj in objs:
            obj.unref()
        await tier.aclose()
        plain.sock.close()
    report: dict[str, Any] = {k: round(statistics.median(v) * 1e3, 2) for k, v in times.items()}
    for tier_side, plain_side in (("tier_put", "plain_set"), ("tier_get", "plain_get")):
        ratios = [a / b for a, b in zip(times[tier_side], times[plain_side], strict=True)]
        report[f"{tier_side}_ratio"] = round(statistics.median(ratios), 2)
    report.update(chunks=chunks, chunk_bytes=chunk_bytes, rounds=rounds, url=url)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--chunk-mib", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--url", default=None)
    args = parser.parse_args()
    chunk_bytes = int(args.chunk_mib * (1 << 20)) // (WIDTH * 2) * (WIDTH * 2)
    server = None
    workdir = None
    if args.url is None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("redis-server not found: run `make redis`")
        workdir = tempfile.mkdtemp(prefix="wire-bench-")
        port = free_port()
        server = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
             "no", "--dir", workdir],
            stdout=subprocess.DEVNULL,
        )
        url, host = f"redis://127.0.0.1:{port}", "127.0.0.1"
        for _ in range(200):
            try:
                socket.create_connection((host, port), timeout=0.1).close()
                break
            except OSError:
                time.sleep(0.02)
    else:
        url = args.url
        rest = url.split("://", 1)[1].rsplit("@", 1)[-1]
        host, _, port_text = rest.split("/", 1)[0].partition(":")
        port = int(port_text or 6379)
    try:
        report = anyio.run(run, url, host, port, args.chunks, chunk_bytes, args.rounds)
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=10)
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
