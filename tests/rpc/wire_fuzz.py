"""A seeded fuzzer of the sidecar's wire protocol, against a real ``lmcache-async serve``.

Hypothesis draws the plan (:func:`plan`): batches of hostile messages (every message type
with valid-ish headers and fields mutated, garbage and truncated frames), scripted
out-of-order sequences, abandoned sessions and a client that never reads its replies. The
same seed draws the same plan. :class:`FuzzRunner` sends it to one sidecar process in
batches, classifies every reply the hostile side reads, and after each batch checks that
the sidecar lives, answers a PING and serves a well-behaved client byte-exact. At the end
it waits for the hostile sessions to be reaped and compares the sidecar's open
transactions, descriptors and resident memory with a baseline taken before the fuzz.

Run from the command line (the sidecar is started and stopped here)::

    python -m tests.rpc.wire_fuzz --messages 20000 --seed 1

SHUTDOWN is the one type no drawn message can get through decoding (a local ipc peer is an
admin): it would end the run, not test it.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import torch
import zmq
import zmq.asyncio

from lmcache_async import RemoteCacheEngine
from lmcache_async.rpc.admin import AdminClient
from lmcache_async.rpc.protocol import Message, decode
from tests.rpc.fuzz_plan import (
    BAIT,
    CHECK_TIMEOUT,
    FAILURE_EVENTS,
    FD_MARGIN,
    FIELDS,
    FINE_CODES,
    HELLO_FIELDS,
    MAX_HEADER,
    REPLY_TIMEOUT,
    RSS_MARGIN_KIB,
    SETTLE_TIMEOUT,
    WORKERS,
    Abandon,
    Batch,
    Case,
    Long,
    M,
    Script,
    Shot,
    check_prompt,
    frame_of,
    plan,
)
from tests.rpc.test_sidecar import (
    CHUNK,
    LAYOUT,
    MODEL,
    Sidecar,
    Sidecars,
    kv_for,
    payload_of,
    ping,
    wait_ready,
)
from tests.test_engine import poll_until

# -- the run ----------------------------------------------------------------------------------


@dataclass
class FuzzSummary:
    """What a run sent, what came back, and the sidecar's state before and after."""

    seed: int
    messages: int = 0
    """Hostile messages sent (the well-behaved checks not counted)."""
    batches: int = 0
    replies: collections.Counter[str] = field(default_factory=collections.Counter)
    """Replies the hostile side read, by error code (``ok``: a reply of the request's type)."""
    replies_by_case: collections.Counter[str] = field(default_factory=collections.Counter)
    """The same, as ``"what was sent: code"`` (what was sent: the label's first word)."""
    silent: int = 0
    """Requests that got no reply where none is due (a RELEASE)."""
    kinds: collections.Counter[str] = field(default_factory=collections.Counter)
    """Cases run by kind: ``field:NAME``, ``garbage:HOW``, ``script:NAME``, ``abandon``..."""
    abandoned_sessions: int = 0
    deaf_requests: int = 0
    peak_transactions: int = 0
    check_retries: int = 0
    failures: list[str] = field(default_factory=list)
    fds_before: int = 0
    fds_after: int = 0
    rss_before_kib: int = 0
    rss_after_kib: int = 0
    shmem_before_kib: int = 0
    """Of the RSS, the shared memory touched (the arena's pages count once touched)."""
    shmem_after_kib: int = 0
    transactions_after: int = -1
    duration_s: float = 0.0

    def text(self) -> str:
        codes = ", ".join(f"{code} {n}" for code, n in sorted(self.replies.items()))
        lines = [
            f"seed {self.seed}: {self.messages} messages in {self.batches} batches, "
            f"{self.duration_s:.1f} s",
            f"replies: {codes}; no reply (RELEASE): {self.silent}",
            f"abandoned sessions {self.abandoned_sessions}, unread requests "
            f"{self.deaf_requests}, peak open transactions {self.peak_transactions}, "
            f"check retries {self.check_retries}",
            f"fds {self.fds_before} -> {self.fds_after} (margin {FD_MARGIN}); RSS "
            f"{self.rss_before_kib} -> {self.rss_after_kib} KiB (margin {RSS_MARGIN_KIB}; "
            f"shared memory {self.shmem_before_kib} -> {self.shmem_after_kib}); "
            f"open transactions after {self.transactions_after}",
            f"failures: {len(self.failures)}",
            *(f"  {failure}" for failure in self.failures[:50]),
        ]
        return "\n".join(lines)


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    """A figure of /proc/PID/status in KiB: ``VmRSS``, ``RssShmem``..."""
    text = Path(f"/proc/{pid}/status").read_text()
    found = re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE)
    return int(found.group(1)) if found else 0


class Lost(Exception):
    """The sidecar died: the run ends."""


class Hostile:
    """One raw DEALER of the fuzz: sends frames, reads replies and classifies each."""

    def __init__(self, runner: FuzzRunner) -> None:
        self._runner = runner
        self.socket = runner.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(runner.url)
        self._ids = iter(range(1, 1 << 40))

    def close(self) -> None:
        self.socket.close(linger=0)

    async def send(self, shot: Shot) -> int:
        request_id = next(self._ids)
        await self.socket.send_multipart(shot.frames(request_id))
        self._runner.summary.messages += 1
        return request_id

    async def ask(self, shot: Shot) -> Message | None:
        """Send ``shot`` and wait for its reply (classified); None when none came (a
        failure unless the shot may go unanswered)."""
        try:
            return await self._ask(shot)
        except Unreadable:
            return None

    async def _ask(self, shot: Shot) -> Message | None:
        request_id = await self.send(shot)
        if shot.silent:
            # Served in order: a STATS sent after it is answered after it (if at all).
            barrier = await self.send(Shot("barrier", bytes((int(M.STATS),)), {"v": 2}))
            reply = None
            while True:
                got = await self._receive(shot)
                if got is None:
                    return None
                if got.request_id == barrier:
                    if reply is None:
                        self._runner.summary.silent += 1
                    return reply
                reply = got
        while True:
            got = await self._receive(shot)
            if got is None:
                self._runner.fail(f"no reply within {REPLY_TIMEOUT} s to {describe(shot)}")
                return None
            if got.request_id in (request_id, None) or not isinstance(shot.header, dict):
                return got
            sent = shot.header.get("id", request_id)
            if (sent.build() if isinstance(sent, Long) else sent) == got.request_id:
                return got

    async def _receive(self, shot: Shot) -> Message | None:
        """The next reply, classified; None after ``REPLY_TIMEOUT`` (or an unreadable
        reply, reported here)."""
        with anyio.move_on_after(REPLY_TIMEOUT):
            frames = await self.socket.recv_multipart()
            try:
                # An echoed request id may be as long as the request's header allowed.
                reply = decode(frames, max_header_bytes=MAX_HEADER + 64)
            except Exception as exc:
                self._runner.fail(f"unreadable reply ({exc}) to {describe(shot)}")
                raise Unreadable from None
            self._runner.classify(reply, shot)
            return reply
        return None


class Unreadable(Exception):
    """A reply could not be decoded (already reported)."""


def describe(shot: Shot) -> str:
    frames = shot.frames(0)
    shown = [f[:120] for f in frames[:3]]
    return f"{shot.label} frames={shown!r} ({len(frames)} frames, {sum(map(len, frames))} bytes)"


def ok(reply: Message | None) -> bool:
    return reply is not None and reply.type is not M.ERROR


class FuzzRunner:
    """Sends a plan to one running sidecar and checks it after every batch (see the
    module's docstring); :meth:`run` returns the :class:`FuzzSummary`."""

    def __init__(self, sidecar: Sidecar, seed: int) -> None:
        self.sidecar = sidecar
        self.url = sidecar.url
        self.summary = FuzzSummary(seed)
        self.context = zmq.asyncio.Context()
        self._admin = AdminClient(self.url, timeout=REPLY_TIMEOUT)
        self._checks = 0

    def fail(self, text: str) -> None:
        self.summary.failures.append(f"batch {self.summary.batches}: {text}")

    def classify(self, reply: Message, shot: Shot) -> None:
        code = "ok" if reply.type is not M.ERROR else str(reply.header.get("code"))
        self.summary.replies[code] += 1
        self.summary.replies_by_case[f"{shot.label.split(' ')[0]}: {code}"] += 1
        if reply.type is not M.ERROR:
            return
        if code not in FINE_CODES:
            self.fail(f"{code} reply ({reply.header.get('message')!r:.300}) to {describe(shot)}")

    async def run(self, batches: Sequence[Batch]) -> FuzzSummary:
        started = time.monotonic()
        pid = self.sidecar.process.pid
        try:
            await self.check()  # opens the engine and fixes the namespace
            self.summary.fds_before, self.summary.rss_before_kib = open_fds(pid), rss_kib(pid)
            self.summary.shmem_before_kib = rss_kib(pid, "RssShmem")
            for batch in batches:
                await self.batch(batch)
                self.summary.batches += 1
                await self.check()
            await self.settle(pid)
        except Lost:
            self.fail(f"the sidecar exited with {self.sidecar.process.poll()}")
        finally:
            self._admin.close()
            self.context.destroy(linger=0)
        self.summary.duration_s = time.monotonic() - started
        self.read_log()
        return self.summary

    async def batch(self, batch: Batch) -> None:
        workers = [Hostile(self) for _ in range(WORKERS)]
        deaf = Hostile(self)
        try:
            for worker in workers:
                await self.hello(worker)
            await self.deafen(deaf, batch.deaf)
            async with anyio.create_task_group() as group:
                for index, worker in enumerate(workers):
                    group.start_soon(self.work, worker, batch.cases[index::WORKERS])
            stats = await self._admin.stats()
            self.summary.peak_transactions = max(
                self.summary.peak_transactions, stats["server"]["transactions"]
            )
        finally:
            for worker in [*workers, deaf]:
                worker.close()

    async def hello(self, client: Hostile) -> Message | None:
        return await client.ask(Shot("HELLO", bytes((int(M.HELLO),)), {"v": 2, **HELLO_FIELDS}))

    async def work(self, worker: Hostile, cases: Sequence[Case]) -> None:
        for case in cases:
            if isinstance(case, Shot):
                self.summary.kinds[case.label.split(" ")[0].split("(")[0]] += 1
                reply = await worker.ask(case)
                if ok(reply) and reply is not None and "txn" in reply.header:
                    await self.follow(worker, case, reply)
            elif isinstance(case, Script):
                self.summary.kinds[f"script:{case.name}"] += 1
                await self.script(worker, case)
            else:
                self.summary.kinds["abandon"] += 1
                await self.abandon(case)

    async def follow(self, worker: Hostile, shot: Shot, reply: Message) -> None:
        """End (or not) the transaction a STORE or RETRIEVE opened, as ``shot.follow`` says."""
        txn = reply.header["txn"]
        sizes = [chunk[3] for chunk in reply.header.get("chunks", [])]
        how = shot.follow
        is_store = shot.type_frame == bytes((int(M.STORE),))
        if how == "leave":
            return
        if is_store and how in ("commit", "abort", "wrong-size"):
            payloads = tuple(bytes(n + (how == "wrong-size")) for n in sizes)
            header = {"v": 2, "txn": txn, "abort": how == "abort"}
            await worker.ask(
                Shot(f"COMMIT follow:{how}", bytes((int(M.COMMIT),)), header, payloads)
            )
        elif how.startswith("release"):
            release = Shot("RELEASE follow", bytes((int(M.RELEASE),)), {"v": 2, "txn": txn})
            for _ in range(2 if how == "release-twice" else 1):
                await worker.ask(release)

    async def deafen(self, deaf: Hostile, count: int) -> None:
        """Send ``count`` requests (a HELLO first) from a client that never reads."""
        if not count:
            return
        frame, bait = frame_of(range(2 * CHUNK)), frame_of(BAIT)

        def shot(index: int) -> Shot:
            kind, header, payload = [
                (M.STORE, {}, frame),
                (M.LOOKUP, {"pin": True, "lookup_id": index}, bait),
                (M.RETRIEVE, {}, bait),
                (M.PREFETCH, {"lookup_id": f"p{index}"}, bait),
            ][index % 4]
            return Shot(f"unread {kind.name}", bytes((int(kind),)), {"v": 2, **header}, (payload,))

        with anyio.move_on_after(REPLY_TIMEOUT):
            await deaf.send(Shot("unread HELLO", bytes((int(M.HELLO),)), {"v": 2, **HELLO_FIELDS}))
            for index in range(count):
                await deaf.send(shot(index))
                self.summary.deaf_requests += 1
        self.summary.kinds["deaf"] += 1

    async def script(self, worker: Hostile, case: Script) -> None:
        """One out-of-order sequence; ``worker`` holds a session, others are fresh."""
        store = Shot(
            "STORE",
            bytes((int(M.STORE),)),
            {"v": 2},
            (frame_of(range(case.kind, case.kind + CHUNK)),),
        )
        retrieve = Shot("RETRIEVE bait", bytes((int(M.RETRIEVE),)), {"v": 2}, (frame_of(BAIT),))

        def commit(txn: object, label: str) -> Shot:
            return Shot(f"COMMIT {label}", bytes((int(M.COMMIT),)), {"v": 2, "txn": txn})

        def release(txn: object, label: str) -> Shot:
            return Shot(f"RELEASE {label}", bytes((int(M.RELEASE),)), {"v": 2, "txn": txn})

        def txn_of(reply: Message | None) -> object:
            return reply.header.get("txn") if ok(reply) and reply is not None else None

        name = case.name
        if name == "before-hello":
            fresh = Hostile(self)
            try:
                template = FIELDS[M(case.kind)]
                shot = Shot(
                    f"{M(case.kind).name} before-hello",
                    bytes((case.kind,)),
                    {"v": 2, **dict.fromkeys(template[:1], 1)},
                    (frame_of(BAIT),),
                )
                reply = await fresh.ask(shot)
                if reply is not None and reply.header.get("code") != "no_session":
                    self.fail(f"{describe(shot)} got {reply.header} instead of no_session")
            finally:
                fresh.close()
        elif name in ("foreign-commit", "foreign-release"):
            other = Hostile(self)
            try:
                await self.hello(other)
                if name == "foreign-commit":
                    txn = txn_of(await other.ask(store))
                    if txn is not None:
                        await worker.ask(commit(txn, "of another session"))
                        await other.ask(commit(txn, "own after a foreign one"))
                else:
                    txn = txn_of(await other.ask(retrieve))
                    if txn is not None:
                        await worker.ask(release(txn, "of another session"))
                        await other.ask(release(txn, "own after a foreign one"))
            finally:
                other.close()
        elif name == "double-commit":
            txn = txn_of(await worker.ask(store))
            if txn is not None:
                await worker.ask(commit(txn, "first"))
                await worker.ask(commit(txn, "again"))
        elif name == "double-release":
            txn = txn_of(await worker.ask(retrieve))
            if txn is not None:
                await worker.ask(release(txn, "first"))
                await worker.ask(release(txn, "again"))
        elif name == "release-a-store":
            txn = txn_of(await worker.ask(store))
            if txn is not None:
                await worker.ask(release(txn, "of a store"))
                await worker.ask(commit(txn, "after a release of it"))
        elif name == "commit-a-retrieve":
            txn = txn_of(await worker.ask(retrieve))
            if txn is not None:
                await worker.ask(commit(txn, "of a retrieve"))
                await worker.ask(release(txn, "after a commit of it"))
        elif name == "unknown-txn":
            await worker.ask(commit(case.number, "unknown"))
            await worker.ask(release(case.number, "unknown"))
        elif name == "hello-twice":
            await self.hello(worker)
        elif name == "unpin-unknown":
            await worker.ask(
                Shot("UNPIN unknown", bytes((int(M.UNPIN),)), {"v": 2, "lookup_id": case.number})
            )
        elif name == "stream-late-part":
            header = {"v": 2, "stream": True, "part": 3, "lookup_id": "late"}
            reply = await worker.ask(
                Shot("RETRIEVE late part", bytes((int(M.RETRIEVE),)), header, (frame_of(BAIT),))
            )
            if txn_of(reply) is not None:
                await worker.ask(release(txn_of(reply), "late part"))

    async def abandon(self, case: Abandon) -> None:
        client = Hostile(self)
        try:
            await self.hello(client)
            for index, op in enumerate(case.ops):
                header: dict[str, Any] = {"v": 2}
                kind = {
                    "store": M.STORE,
                    "pin": M.LOOKUP,
                    "prefetch": M.PREFETCH,
                    "retrieve": M.RETRIEVE,
                    "promise": M.LOOKUP,
                }[op]
                frame = frame_of(BAIT)
                if op == "store":
                    frame = frame_of(range(index * CHUNK, (index + 2) * CHUNK))
                elif op == "pin":
                    header.update(pin=True, lookup_id=index)
                elif op == "promise":
                    header.update(promise=True, lookup_id=f"promise{index}")
                elif op == "prefetch":
                    header.update(lookup_id=f"prefetch{index}")
                await client.ask(Shot(f"abandon {op}", bytes((int(kind),)), header, (frame,)))
            self.summary.abandoned_sessions += 1
        finally:
            client.close()

    async def check(self) -> None:
        """The sidecar lives, answers a PING and serves a well-behaved client byte-exact
        (after the freeze and hot-cache switches a hostile admin may have flipped)."""
        if not self.sidecar.alive():
            raise Lost
        index = self._checks
        self._checks += 1
        tokens = check_prompt(index)
        kv, slots = kv_for(len(tokens), seed=index)
        try:
            with anyio.fail_after(CHECK_TIMEOUT):
                if not await ping(self.url, REPLY_TIMEOUT):
                    self.fail("no answer to a PING")
                async with RemoteCacheEngine.connect(
                    self.url, LAYOUT, model_name=MODEL, timeout=REPLY_TIMEOUT
                ) as engine:
                    await self._admin.freeze(False)
                    await self._admin.set_hot_cache(True)
                    bait_kv, bait_slots = kv_for(len(BAIT), seed=1)
                    await engine.store(BAIT, kv_caches=bait_kv, slot_mapping=bait_slots)
                    # Payloads a hostile session holds (an open store takes what it can of
                    # the pool) go back when it is reaped, 1 s after its last message:
                    # until then a store may be short or evicted at once. Tried again.
                    while not await self._round_trip(engine, tokens, kv, slots):
                        self.summary.check_retries += 1
        except Exception as exc:
            if not self.sidecar.alive():
                raise Lost from exc
            self.fail(f"check {index}: a well-behaved client was not served: {exc!r}")

    async def _round_trip(
        self,
        engine: RemoteCacheEngine,
        tokens: list[int],
        kv: list[torch.Tensor],
        slots: torch.Tensor,
    ) -> bool:
        """Store ``tokens`` and load them back: whether every byte came back."""
        if await engine.store(tokens, kv_caches=kv, slot_mapping=slots) < len(tokens):
            return False
        target = [torch.zeros_like(layer) for layer in kv]
        mask = await engine.retrieve(tokens, kv_caches=target, slot_mapping=slots)
        loaded, wanted = payload_of(target, slots), payload_of(kv, slots)
        return bool(mask.all()) and torch.equal(loaded.view(torch.int16), wanted.view(torch.int16))

    async def settle(self, pid: int) -> None:
        """Wait (bounded) until the hostile sessions are reaped and their descriptors
        closed; record what is left."""
        summary = self.summary
        try:
            with anyio.fail_after(SETTLE_TIMEOUT):
                while True:
                    server = (await self._admin.stats())["server"]
                    summary.transactions_after = server["transactions"]
                    if server["transactions"] == 0 and server["sessions"] == 0:
                        break
                    await anyio.sleep(0.05)
        except TimeoutError:
            self.fail(f"sessions not reaped in {SETTLE_TIMEOUT} s: {server}")
        limit = summary.fds_before + FD_MARGIN
        with contextlib.suppress(TimeoutError):
            await poll_until(lambda: open_fds(pid) <= limit, timeout=SETTLE_TIMEOUT)
        summary.fds_after, summary.rss_after_kib = open_fds(pid), rss_kib(pid)
        summary.shmem_after_kib = rss_kib(pid, "RssShmem")
        if summary.fds_after > limit:
            self.fail(f"the sidecar holds {summary.fds_after} fds (baseline {summary.fds_before})")
        if summary.rss_after_kib > summary.rss_before_kib + RSS_MARGIN_KIB:
            self.fail(
                f"the sidecar's RSS grew from {summary.rss_before_kib} to "
                f"{summary.rss_after_kib} KiB"
            )

    def read_log(self) -> None:
        lines = self.sidecar.log().splitlines()
        for number, line in enumerate(lines):
            if "Traceback" in line or any(event in line for event in FAILURE_EVENTS):
                excerpt = "\n".join(lines[max(0, number - 3) : number + 25])
                self.summary.failures.append(f"sidecar log line {number + 1}:\n{excerpt}")
                break


# -- starting a sidecar and running the whole thing -------------------------------------------


@contextlib.contextmanager
def started_sidecar(log_dir: Path) -> Iterator[Sidecar]:
    """A fresh ``lmcache-async serve`` (the test flags) on an ipc socket in a short /tmp
    directory, stopped on exit."""
    short = Path(tempfile.mkdtemp(prefix="lmc-fz-", dir="/tmp"))  # ipc paths: 107 bytes
    launcher = Sidecars(log_dir)
    try:
        yield launcher.start(f"ipc://{short}/fuzz.sock")
    finally:
        launcher.stop_all()
        shutil.rmtree(short, ignore_errors=True)


async def fuzz(sidecar: Sidecar, *, messages: int, seed: int, batch_size: int = 100) -> FuzzSummary:
    """Fuzz a started sidecar with at least ``messages`` hostile messages (every case
    sends one or more) drawn from ``seed``."""
    count = max(1, -(-messages // batch_size))
    drawn = await anyio.to_thread.run_sync(plan, seed, count, batch_size)
    await wait_ready(sidecar)
    return await FuzzRunner(sidecar, seed).run(drawn)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=5_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=100)
    args = parser.parse_args(argv)
    log_dir = Path(tempfile.mkdtemp(prefix="lmc-fuzz-logs-"))
    with started_sidecar(log_dir) as sidecar:
        summary = anyio.run(
            lambda: fuzz(sidecar, messages=args.messages, seed=args.seed, batch_size=args.batch)
        )
    print(summary.text())
    print(f"sidecar log: {log_dir}")
    return 1 if summary.failures else 0


if __name__ == "__main__":
    sys.exit(main())
