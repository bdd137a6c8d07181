"""The sidecar's input limits: every malformed or oversized field of a request is an ERROR
reply coded ``invalid_input`` (or ``protocol`` where the frame itself is wrong), never
``internal`` and never a logged traceback, and the sidecar serves well-behaved clients
exactly afterwards. A RELEASE's ``loaded`` figure is a client's claim: the engine counts at
most what the sidecar lent in that transaction.

One sidecar serves the module, in this process (its logs are captured with the test's);
each case speaks the wire protocol on a raw DEALER socket of its own.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator, MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import anyio
import msgpack
import pytest
import structlog
import torch
import zmq
import zmq.asyncio

from lmcache_async import EngineConfig, RemoteCacheEngine
from lmcache_async.keys.block_hashes import BLOCK_HASH_INT_BYTES, MAX_BLOCK_HASH_BYTES
from lmcache_async.keys.chunks import DIGEST_SIZE
from lmcache_async.keys.tokens import TOKEN_BYTES
from lmcache_async.rpc.protocol import (
    PROTOCOL_VERSION,
    Message,
    MessageLimits,
    MessageType,
    decode,
    encode,
)
from lmcache_async.rpc.sidecar import SidecarNamespace, SidecarServer, SidecarSettings
from lmcache_async.rpc.sidecar.fields import MAX_ID_CHARS, MAX_TIER_NAMES
from lmcache_async.tenancy.tenants import TAG_BYTES, tenant_tag
from tests.rpc.test_sidecar import CHUNK, LAYOUT, MODEL, in_process, kv_for, payload_of, prompt

pytestmark = pytest.mark.anyio

TIMEOUT: Final = 30.0
LIMITS: Final = MessageLimits(max_header_bytes=1 << 20, max_payload_bytes=1 << 20)
MAX_CHUNKS: Final = LIMITS.max_payload_bytes // TOKEN_BYTES // CHUNK
"""The most chunks a request may name: those of the longest prompt a token frame holds."""
HELLO: Final = SidecarNamespace(MODEL, LAYOUT).to_wire()
TOKENS: Final = b"".join(i.to_bytes(TOKEN_BYTES, "little") for i in range(2 * CHUNK))
DIGEST: Final = tenant_tag(None) + bytes(DIGEST_SIZE - TAG_BYTES)
"""A chunk digest of the session's own tenant (its tag leads it)."""
BIG: Final = 100_000  # bytes of a hostile block hash
FAILURES: Final = frozenset({"sidecar_request_failed", "sidecar_handler_failed"})


@dataclass(frozen=True)
class Served:
    url: str
    server: SidecarServer


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def short_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="lmc-il-", dir="/tmp"))  # ipc paths: 107 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
async def sidecar(short_dir: Path) -> AsyncIterator[Served]:
    url = f"ipc://{short_dir}/limits.sock"
    settings = SidecarSettings(
        listen=url,
        config=EngineConfig(chunk_size=CHUNK, max_local_cpu_size=0.02),
        limits=LIMITS,
        heartbeat_interval=30.0,  # raw clients send no heartbeats: their sessions stay
    )
    async with in_process(settings) as server:
        yield Served(url, server)


class RawClient:
    """A DEALER socket that said HELLO: requests go out as built, replies come back
    decoded."""

    def __init__(self, url: str) -> None:
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(url)
        self._ids = iter(range(1, 1 << 30))

    async def send_frames(self, frames: Sequence[Any]) -> None:
        await self._socket.send_multipart(frames)

    async def recv(self) -> Message:
        return decode(await self._socket.recv_multipart())

    async def ask(
        self, kind: MessageType, header: dict[str, Any], payloads: Sequence[object] = ()
    ) -> Message:
        await self.send(kind, header, payloads)
        return await self.recv()

    async def send(
        self, kind: MessageType, header: dict[str, Any], payloads: Sequence[object] = ()
    ) -> None:
        await self.send_frames(encode(kind, header, payloads, request_id=next(self._ids)))

    async def hello(self) -> None:
        reply = await self.ask(MessageType.HELLO, HELLO)
        assert reply.type is MessageType.HELLO, reply.header

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()


async def raw_client(url: str) -> RawClient:
    client = RawClient(url)
    await client.hello()
    return client


def failures(logs: Sequence[MutableMapping[str, Any]]) -> list[MutableMapping[str, Any]]:
    """The captured log entries of a request that failed inside the sidecar."""
    return [
        entry for entry in logs if entry["event"] in FAILURES or entry.get("exc_info") is not None
    ]


def nested(depth: int) -> bytes:
    """A raw header whose ``"hashes"`` nests ``depth`` one-element lists."""
    fields: bytes = msgpack.packb({"v": PROTOCOL_VERSION, "hashes": 0})
    return fields[:-1] + b"\x91" * depth + b"\x00"  # the last value, 0, nested in lists


def wide(size: int) -> list[bytes]:
    """A block hash int of ``size`` bytes as the wire carries it: ``[signed bytes]``."""
    return [b"\x01" * size]


LOOKUP, PREFETCH, UNPIN = MessageType.LOOKUP, MessageType.PREFETCH, MessageType.UNPIN
STORE, COMMIT, RETRIEVE = MessageType.STORE, MessageType.COMMIT, MessageType.RETRIEVE
RELEASE, PUSH, HELLO_TYPE = MessageType.RELEASE, MessageType.PUSH, MessageType.HELLO
BAD, PROTO = "invalid_input", "protocol"
TOO_MANY = MAX_CHUNKS + 1

# (message type, header, payloads, the code of the ERROR reply)
CASES: Final[dict[str, tuple[MessageType, dict[str, Any] | bytes, list[bytes], str]]] = {
    # Block hashes: bounded in size and count, of the wire's forms only.
    "lookup-hash-int-100000-bytes": (LOOKUP, {"hashes": [wide(BIG)], "offsets": [CHUNK]}, [], BAD),
    "lookup-hash-bytes-100000": (LOOKUP, {"hashes": [b"\1" * BIG], "offsets": [CHUNK]}, [], BAD),
    "lookup-hash-bytes-over-max": (
        LOOKUP,
        {"hashes": [1, b"\1" * (MAX_BLOCK_HASH_BYTES + 1)], "offsets": [CHUNK, 2 * CHUNK]},
        [],
        BAD,
    ),
    "lookup-hash-int-over-max": (
        LOOKUP,
        {"hashes": [wide(BLOCK_HASH_INT_BYTES + 1)], "offsets": [CHUNK]},
        [],
        BAD,
    ),
    "lookup-too-many-hashes": (
        LOOKUP,
        {"hashes": [0] * TOO_MANY, "offsets": [CHUNK * (i + 1) for i in range(TOO_MANY)]},
        [],
        BAD,
    ),
    "lookup-offsets-not-one-per-hash": (
        LOOKUP,
        {"hashes": [1], "offsets": [CHUNK] * TOO_MANY},
        [],
        BAD,
    ),
    "lookup-hash-bool": (LOOKUP, {"hashes": [True], "offsets": [CHUNK]}, [], PROTO),
    "lookup-hash-float": (LOOKUP, {"hashes": [1.5], "offsets": [CHUNK]}, [], PROTO),
    "lookup-hashes-str": (LOOKUP, {"hashes": "abc", "offsets": [CHUNK]}, [], PROTO),
    "lookup-hash-nested": (LOOKUP, {"hashes": [[[b"a"]]], "offsets": [CHUNK]}, [], PROTO),
    "lookup-hashes-nested-deep": (LOOKUP, nested(100_000), [], PROTO),
    "lookup-offset-bool": (LOOKUP, {"hashes": [1], "offsets": [True]}, [], BAD),
    "lookup-offset-negative": (LOOKUP, {"hashes": [1], "offsets": [-CHUNK]}, [], BAD),
    "lookup-offset-huge": (LOOKUP, {"hashes": [1], "offsets": [2**64 - 1]}, [], BAD),
    "lookup-offsets-not-a-list": (LOOKUP, {"hashes": [1], "offsets": CHUNK}, [], PROTO),
    # Digests and token frames.
    "lookup-too-many-digests": (
        LOOKUP,
        {"digests_of": TOO_MANY * CHUNK},
        [DIGEST * TOO_MANY],
        BAD,
    ),
    "lookup-digests-of-huge": (LOOKUP, {"digests_of": 2**64 - 1}, [bytes(DIGEST_SIZE)], BAD),
    "lookup-digests-of-negative": (LOOKUP, {"digests_of": -1}, [bytes(DIGEST_SIZE)], PROTO),
    "lookup-digests-of-bool": (LOOKUP, {"digests_of": True}, [bytes(DIGEST_SIZE)], PROTO),
    "lookup-digests-of-float": (LOOKUP, {"digests_of": 1.5}, [bytes(DIGEST_SIZE)], PROTO),
    "lookup-token-frame-ragged": (LOOKUP, {}, [b"\1\2\3"], PROTO),
    "lookup-token-negative": (LOOKUP, {}, [b"\xff" * TOKEN_BYTES], BAD),
    "lookup-no-keys": (LOOKUP, {}, [], PROTO),
    # Ids, flags, tier lists and tenants.
    "lookup-pin-not-bool": (LOOKUP, {"pin": 1, "lookup_id": 1}, [TOKENS], PROTO),
    "lookup-id-float": (LOOKUP, {"pin": True, "lookup_id": 1.5}, [TOKENS], PROTO),
    "lookup-id-too-long": (
        LOOKUP,
        {"pin": True, "lookup_id": "i" * (MAX_ID_CHARS + 1)},
        [TOKENS],
        BAD,
    ),
    "lookup-search-range-str": (LOOKUP, {"search_range": "cpu"}, [TOKENS], PROTO),
    "lookup-search-range-unknown": (LOOKUP, {"search_range": ["nope"]}, [TOKENS], BAD),
    "lookup-search-range-long": (
        LOOKUP,
        {"search_range": ["cpu"] * (MAX_TIER_NAMES + 1)},
        [TOKENS],
        BAD,
    ),
    "lookup-tenant-int": (LOOKUP, {"tenant": 5}, [TOKENS], BAD),
    "lookup-tenant-long": (LOOKUP, {"tenant": "t" * 100_000}, [TOKENS], BAD),
    "promise-no-lookup-id": (LOOKUP, {"promise": True}, [TOKENS], BAD),
    "promise-speed-nan": (
        LOOKUP,
        {"promise": True, "lookup_id": 1, "prefill_tps": float("nan")},
        [TOKENS],
        BAD,
    ),
    "promise-wait-negative": (
        LOOKUP,
        {"promise": True, "lookup_id": 1, "wait": -1},
        [TOKENS],
        BAD,
    ),
    "promise-wait-str": (LOOKUP, {"promise": True, "lookup_id": 1, "wait": "1"}, [TOKENS], BAD),
    "promise-speed-bool": (
        LOOKUP,
        {"promise": True, "lookup_id": 1, "prefill_tps": True},
        [TOKENS],
        BAD,
    ),
    "promise-computed-negative": (
        LOOKUP,
        {"promise": True, "lookup_id": 1, "computed": -1},
        [TOKENS],
        PROTO,
    ),
    "promise-hash-int-100000-bytes": (
        LOOKUP,
        {"promise": True, "lookup_id": 1, "hashes": [wide(BIG)], "offsets": [CHUNK]},
        [],
        BAD,
    ),
    "prefetch-hash-int-100000-bytes": (
        PREFETCH,
        {"lookup_id": 1, "hashes": [wide(BIG)], "offsets": [CHUNK]},
        [],
        BAD,
    ),
    "prefetch-no-lookup-id": (PREFETCH, {}, [TOKENS], BAD),
    "prefetch-id-too-long": (PREFETCH, {"lookup_id": "i" * (MAX_ID_CHARS + 1)}, [TOKENS], BAD),
    "unpin-id-list": (UNPIN, {"lookup_id": [1]}, [], PROTO),
    "unpin-id-too-long": (UNPIN, {"lookup_id": "i" * (MAX_ID_CHARS + 1)}, [], BAD),
    # Stores.
    "store-hash-int-100000-bytes": (STORE, {"hashes": [wide(BIG)], "offsets": [CHUNK]}, [], BAD),
    "store-hash-bytes-100000": (STORE, {"hashes": [b"\1" * BIG], "offsets": [CHUNK]}, [], BAD),
    "store-start-negative": (STORE, {"start": -CHUNK}, [TOKENS], PROTO),
    "store-start-bool": (STORE, {"start": True}, [TOKENS], PROTO),
    "store-start-off-boundary": (STORE, {"start": 1}, [TOKENS], BAD),
    "store-limit-str": (STORE, {"limit": "all"}, [TOKENS], PROTO),
    "store-req-id-list": (STORE, {"req_id": [1, {"a": 2}]}, [TOKENS], PROTO),
    "store-req-id-too-long": (STORE, {"req_id": "r" * (MAX_ID_CHARS + 1)}, [TOKENS], BAD),
    "store-timeout-nan": (STORE, {"timeout": float("nan")}, [TOKENS], PROTO),
    "store-timeout-negative": (STORE, {"timeout": -1.0}, [TOKENS], PROTO),
    "store-location-unknown": (STORE, {"store_location": ["nope"]}, [TOKENS], BAD),
    "commit-txn-str": (COMMIT, {"txn": "1"}, [], PROTO),
    "commit-txn-bool": (COMMIT, {"txn": True}, [], PROTO),
    "commit-txn-missing": (COMMIT, {}, [], PROTO),
    # Loads.
    "retrieve-hash-int-100000-bytes": (
        RETRIEVE,
        {"hashes": [wide(BIG)], "offsets": [CHUNK]},
        [],
        BAD,
    ),
    "retrieve-stream-not-bool": (RETRIEVE, {"stream": "yes"}, [TOKENS], PROTO),
    "retrieve-part-negative": (RETRIEVE, {"stream": True, "part": -1}, [TOKENS], PROTO),
    "retrieve-alloc-wait-negative": (RETRIEVE, {"alloc_wait": -1.0}, [TOKENS], PROTO),
    "retrieve-alloc-wait-nan": (RETRIEVE, {"alloc_wait": float("nan")}, [TOKENS], PROTO),
    "retrieve-inline-not-bool": (RETRIEVE, {"inline": 1}, [TOKENS], PROTO),
    "retrieve-id-too-long": (RETRIEVE, {"lookup_id": "i" * (MAX_ID_CHARS + 1)}, [TOKENS], BAD),
    "retrieve-location-unknown": (RETRIEVE, {"retrieve_locations": ["nope"]}, [TOKENS], BAD),
    "release-txn-str": (RELEASE, {"txn": "1", "loaded": 0}, [], PROTO),
    # Pushes.
    "push-by-hashes": (PUSH, {"hashes": [1], "offsets": [CHUNK]}, [TOKENS], PROTO),
    "push-checksum-negative": (PUSH, {"checksums": [-1]}, [TOKENS, b"\0"], PROTO),
    "push-checksum-bool": (PUSH, {"checksums": [True]}, [TOKENS, b"\0"], PROTO),
    "push-checksums-miscounted": (PUSH, {"checksums": [1, 2]}, [TOKENS, b"\0"], PROTO),
    "push-token-frame-ragged": (PUSH, {"checksums": [1]}, [b"\1\2\3", b"\0"], PROTO),
    # Hellos.
    "hello-client-too-long": (HELLO_TYPE, {**HELLO, "client": "c" * (MAX_ID_CHARS + 1)}, [], BAD),
    "hello-client-list": (HELLO_TYPE, {**HELLO, "client": ["c"]}, [], PROTO),
    "hello-layout-str": (HELLO_TYPE, {**HELLO, "layout": "x"}, [], BAD),
    "hello-layout-negative": (
        HELLO_TYPE,
        {**HELLO, "layout": {**HELLO["layout"], "num_layers": -1}},
        [],
        BAD,
    ),
    "hello-model-int": (HELLO_TYPE, {**HELLO, "model_name": 5}, [], BAD),
    "hello-another-model": (HELLO_TYPE, {**HELLO, "model_name": "other"}, [], BAD),
}


async def send_case(
    client: RawClient, kind: MessageType, header: dict[str, Any] | bytes, payloads: list[bytes]
) -> Message:
    if isinstance(header, bytes):  # a header no encoder would write
        await client.send_frames([bytes((int(kind),)), header, *payloads])
        return await client.recv()
    return await client.ask(kind, header, payloads)


@pytest.mark.parametrize("name", list(CASES))
async def test_a_hostile_field_gets_a_clear_error_reply_never_internal(
    sidecar: Served, name: str
) -> None:
    kind, header, payloads, code = CASES[name]
    client = await raw_client(sidecar.url)
    try:
        with anyio.fail_after(TIMEOUT), structlog.testing.capture_logs() as logs:
            reply = await send_case(client, kind, header, payloads)
            assert (await client.ask(MessageType.PING, {})).type is MessageType.PING
    finally:
        client.close()
    assert reply.type is MessageType.ERROR, reply.header
    assert (reply.header["code"], failures(logs)) == (code, []), reply.header["message"]


async def test_a_100_000_byte_block_hash_is_invalid_input_without_a_traceback(
    sidecar: Served,
) -> None:
    huge = 1 << (8 * BIG - 2)  # an int of 100,000 bytes: more digits than str() writes
    offsets = [CHUNK]
    client = await raw_client(sidecar.url)
    try:
        with anyio.fail_after(TIMEOUT), structlog.testing.capture_logs() as logs:
            wire = [huge.to_bytes(BIG, "little", signed=True)]  # as hashes_to_wire sends it
            as_int = await client.ask(LOOKUP, {"hashes": [wire], "offsets": offsets})
            as_bytes = await client.ask(LOOKUP, {"hashes": [b"\1" * BIG], "offsets": offsets})
    finally:
        client.close()
    for reply in (as_int, as_bytes):
        assert reply.type is MessageType.ERROR
        assert reply.header["code"] == "invalid_input"
        assert f"{BIG} bytes" in reply.header["message"]
    assert failures(logs) == []


async def retrieved_tokens(client: RawClient) -> int:
    reply = await client.ask(MessageType.STATS, {})
    assert reply.type is MessageType.STATS, reply.header
    tokens: int = reply.header["stats"]["retrieved_tokens"]
    return tokens


async def test_release_counts_at_most_what_the_sidecar_lent(sidecar: Served) -> None:
    tokens = prompt(3 * CHUNK, 501)
    kv, slots = kv_for(len(tokens), 5)
    frame = b"".join(t.to_bytes(TOKEN_BYTES, "little") for t in tokens)
    claims = [2**64 - 1, 2**64 - 1, 5]  # inflated twice, then an honest short load
    client = await raw_client(sidecar.url)
    try:
        with anyio.fail_after(TIMEOUT):
            async with RemoteCacheEngine.connect(
                sidecar.url, LAYOUT, model_name=MODEL, timeout=10
            ) as engine:
                assert await engine.store(tokens, kv_caches=kv, slot_mapping=slots) == len(tokens)
            before = await retrieved_tokens(client)
            served = []
            for claim in claims:
                reply = await client.ask(RETRIEVE, {"inline": False}, [frame])
                served.append(sum(end - start for start, end, _, _ in reply.header["chunks"]))
                await client.send(RELEASE, {"txn": reply.header["txn"], "loaded": claim})
            after = await retrieved_tokens(client)
    finally:
        client.close()
    assert served == [len(tokens)] * len(claims)
    assert after - before == 2 * len(tokens) + 5


@pytest.mark.parametrize(("loaded", "salt"), [(-1, 510), ("all", 511), (1.5, 512), (True, 513)])
async def test_a_bad_release_or_commit_gives_the_payloads_back(
    sidecar: Served, loaded: object, salt: int
) -> None:
    frame = b"".join(t.to_bytes(TOKEN_BYTES, "little") for t in prompt(2 * CHUNK, salt))
    client = await raw_client(sidecar.url)
    try:
        with anyio.fail_after(TIMEOUT), structlog.testing.capture_logs() as logs:
            replies = []
            for bad in ("abort", "too-few", "wrong-size"):
                store = await client.ask(STORE, {}, [frame])
                (_, _, _, nbytes), _ = store.header["chunks"]
                commit: tuple[dict[str, Any], list[bytes]] = {
                    "abort": ({"abort": "yes"}, []),
                    "too-few": ({}, [bytes(nbytes)]),  # one payload for two chunks
                    "wrong-size": ({}, [bytes(nbytes), bytes(nbytes + 1)]),
                }[bad]
                header, payloads = commit
                header["txn"] = store.header["txn"]
                replies.append(await client.ask(COMMIT, header, payloads))
            retrieve = await client.ask(RETRIEVE, {"inline": False}, [frame])
            assert retrieve.header["chunks"] == []  # nothing was committed
            stored = await client.ask(STORE, {}, [frame])
            await client.send(COMMIT, {"txn": stored.header["txn"]}, [])
            await client.recv()
            retrieve = await client.ask(RETRIEVE, {"inline": False}, [frame])
            release = await client.ask(RELEASE, {"txn": retrieve.header["txn"], "loaded": loaded})
            stats = await client.ask(MessageType.STATS, {})
    finally:
        client.close()
    assert [reply.header.get("code") for reply in replies] == ["protocol"] * 3
    assert (release.type, release.header["code"]) == (MessageType.ERROR, "protocol")
    assert stats.header["server"]["transactions"] == 0  # every payload given back
    assert failures(logs) == []


async def test_a_well_behaved_client_is_served_exactly_after_every_hostile_case(
    sidecar: Served,
) -> None:
    tokens = prompt(4 * CHUNK + 3, 503)
    kv, slots = kv_for(len(tokens), 6)
    client = await raw_client(sidecar.url)
    try:
        with anyio.fail_after(4 * TIMEOUT), structlog.testing.capture_logs() as logs:
            for kind, header, payloads, _ in CASES.values():
                reply = await send_case(client, kind, header, payloads)
                assert reply.header.get("code") in ("invalid_input", "protocol"), reply.header
            async with RemoteCacheEngine.connect(
                sidecar.url, LAYOUT, model_name=MODEL, timeout=10
            ) as engine:
                stored = await engine.store(tokens, kv_caches=kv, slot_mapping=slots)
                target = [torch.zeros_like(layer) for layer in kv]
                mask = await engine.retrieve(tokens, kv_caches=target, slot_mapping=slots)
    finally:
        client.close()
    assert stored == len(tokens)
    assert mask.tolist() == [True] * len(tokens)
    loaded, wanted = payload_of(target, slots), payload_of(kv, slots)
    assert torch.equal(loaded.view(torch.int16), wanted.view(torch.int16))
    assert failures(logs) == []
