"""Two engine processes share one sidecar: what one stores, the other loads, across a restart.

Starts ``lmcache-async serve`` on an ``ipc://`` socket in a temporary directory and two
workers (this script with ``--worker``), each a :class:`~lmcache_async.RemoteCacheEngine` of
the sidecar, taking commands on stdin. The workers log the library's INFO records to stdout
(``logging``, as any host application may), shown indented.

1. Worker A stores the KV of a prompt (random bytes for a small model); worker B, another
   process, loads it: the SHA-256 of what B loaded equals that of what A stored.
2. The sidecar is stopped (SIGTERM) and started again on the same socket, empty. B's load
   is a miss, not an error; both workers reconnect by themselves (to the new sidecar's
   shared memory); A stores the prompt again and B loads the same bytes.

Every process is stopped at the end; every wait has a timeout. Exit status 0 when every
check passed::

    python examples/shared_sidecar.py [--tokens 512]
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import subprocess
import sys
import tempfile

import anyio
import torch
from anyio.abc import Process
from anyio.streams.buffered import BufferedByteReceiveStream

from lmcache_async import KVLayout, RemoteCacheEngine

TIMEOUT = 60.0
LAYOUT = KVLayout.vllm_flash_attn(
    num_layers=2, block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16
)


async def worker(url: str, tokens: int) -> None:
    """Answer each ``store SEED`` / ``load SEED`` line of stdin: tokens, KV digest."""
    logging.basicConfig(stream=sys.stdout, format="log: %(message)s")
    logging.getLogger("lmcache_async").setLevel(logging.INFO)
    slots = torch.arange(tokens)
    async with RemoteCacheEngine.connect(url, LAYOUT, model_name="shared", timeout=10.0) as engine:
        async for line in anyio.wrap_file(sys.stdin):
            command, seed = line.split()
            generator = torch.Generator().manual_seed(int(seed))  # the same in each process
            ids = torch.randint(0, 32000, (tokens,), generator=generator)
            if command == "store":
                kv = LAYOUT.allocate_kv_caches(tokens // 16, generator=generator)
                n = await engine.store(ids, kv_caches=kv, slot_mapping=slots)
            else:
                kv = LAYOUT.allocate_kv_caches(tokens // 16, random=False)
                mask = await engine.retrieve(ids, kv_caches=kv, slot_mapping=slots)
                n = int(mask.sum())
            sha = hashlib.sha256(b"".join(layer.numpy().tobytes() for layer in kv))
            print("answer", n, sha.hexdigest()[:16], flush=True)


class Child:
    """A child process and its stdout, read line by line under a timeout."""

    def __init__(self, name: str, process: Process) -> None:
        self.name, self.process = name, process
        assert process.stdout is not None
        self.lines = BufferedByteReceiveStream(process.stdout)

    async def line(self, prefix: str) -> str:
        """The next line starting with ``prefix`` (the others, log lines, are shown)."""
        with anyio.fail_after(TIMEOUT):
            while True:
                text = (await self.lines.receive_until(b"\n", 65536)).decode()
                if text.startswith(prefix):
                    return text.removeprefix(prefix).strip()
                print(f"  {self.name} {text}")

    async def ask(self, command: str) -> tuple[int, str]:
        """Send a command to a worker: (tokens stored or loaded, digest of the KV)."""
        assert self.process.stdin is not None
        await self.process.stdin.send(f"{command}\n".encode())
        tokens, sha = (await self.line("answer")).split()
        return int(tokens), sha

    async def ask_until(self, command: str, tokens: int) -> tuple[int, str]:
        """Ask again until ``tokens`` come back (the worker reconnects meanwhile)."""
        with anyio.fail_after(TIMEOUT):
            while (answer := await self.ask(command))[0] != tokens:  # noqa: ASYNC110
                await anyio.sleep(0.1)
        return answer

    async def stop(self) -> None:
        if self.process.returncode is None:
            self.process.terminate()
        with anyio.move_on_after(TIMEOUT):
            await self.process.wait()
        if self.process.returncode is None:
            self.process.kill()
        with anyio.CancelScope(shield=True), anyio.move_on_after(5):
            await self.process.aclose()


async def start(name: str, *args: str) -> Child:
    pipe = subprocess.PIPE
    process = await anyio.open_process(
        [sys.executable, *args], stdin=pipe, stdout=pipe, stderr=None
    )
    return Child(name, process)


async def run(args: argparse.Namespace) -> int:
    n, ok = args.tokens, True
    with tempfile.TemporaryDirectory() as tmp:
        url = f"ipc://{tmp}/sidecar.sock"
        # lmcache-async serve, run as its module: the same command line.
        serve = ["-m", "lmcache_async.cli", "--log-level", "WARNING", "serve", "--listen", url]
        serve += ["--max-local-cpu-size", "0.1"]
        children = [sidecar := await start("sidecar", *serve)]
        try:
            print(f"sidecar: {await sidecar.line('lmcache-async serve: listening on')}")
            worker_args = (__file__, "--worker", url, "--tokens", str(n))
            children += [a := await start("A", *worker_args), b := await start("B", *worker_args)]
            stored, sha_a = await a.ask("store 1")
            loaded, sha_b = await b.ask("load 1")
            print(f"A stored {stored} tokens, B loaded {loaded}, bytes equal: {sha_a == sha_b}")
            ok &= (stored, loaded, sha_b) == (n, n, sha_a)

            await sidecar.stop()
            children[0] = sidecar = await start("sidecar", *serve)
            await sidecar.line("lmcache-async serve: listening on")
            missed, _ = await b.ask("load 1")
            print(f"sidecar restarted: B loaded {missed} tokens (a miss)")
            stored, sha_a = await a.ask_until("store 1", n)
            loaded, sha_b = await b.ask_until("load 1", n)
            print(f"A stored {stored} again, B loaded {loaded}, bytes equal: {sha_a == sha_b}")
            ok &= missed == 0 and sha_a == sha_b
        finally:
            for child in reversed(children):
                await child.stop()
    print("all processes stopped")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512, help="prompt tokens (of 16)")
    parser.add_argument("--worker", metavar="URL", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tokens <= 0 or args.tokens % 16:
        parser.error("--tokens: a positive multiple of 16 (the block size)")
    if args.worker is not None:
        anyio.run(worker, args.worker, args.tokens)
        return 0
    return anyio.run(run, args)


if __name__ == "__main__":
    sys.exit(main())
