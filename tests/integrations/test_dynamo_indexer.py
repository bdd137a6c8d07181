"""Dynamo's standalone KV indexer reads KV events in vLLM's wire format.

A publisher written here with vLLM's own classes (``KVEventBatch`` encoded by msgspec,
multipart ``[topic, seq as 8 bytes big-endian, payload]``) feeds one indexer per test; each
check waits, bounded, until the indexer has consumed what was sent (it consumes
asynchronously). A batch the indexer must ignore is followed by a sentinel batch: once the
sentinel is visible the ignored one has been seen too, since one worker's batches are
applied in order.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import anyio
import msgspec
import pytest
import zmq
import zmq.asyncio

from tests.integrations.dynamo_indexer import (
    DynamoIndexer,
    IndexedBlock,
    TierMatch,
    require_dynamo_indexer,
)

pytest.importorskip("vllm")

from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
)

require_dynamo_indexer()

pytestmark = [pytest.mark.anyio, pytest.mark.subprocess]

BLOCK = 4
MODEL = "test-model"
WORKER = 1
WAIT = 10.0
"""Seconds a check waits for the indexer to consume events (it takes milliseconds)."""

PROMPT = list(range(100, 100 + 3 * BLOCK))
"""Three full blocks."""
OTHER = list(range(900, 900 + 3 * BLOCK))
PROMPT_HASHES = [0xA1, 0xA2, 0xA3]
"""Arbitrary: the indexer hashes tokens itself and uses these only as block ids."""


async def poll_until(check: Callable[[], Awaitable[bool]], interval: float = 0.02) -> None:
    """Poll the indexer until ``check()`` holds; callers bound the wait with
    ``anyio.fail_after``."""
    for _ in itertools.count():
        if await check():
            return
        await anyio.sleep(interval)


class Publisher:
    """A worker's KV event stream in vLLM's wire format on a loopback XPUB socket.

    XPUB is a PUB socket that also hands over its subscriptions, so a test can wait for the
    indexer's subscription instead of losing the first batches to a late join.
    """

    def __init__(self, context: zmq.asyncio.Context, *, topic: bytes = b"") -> None:
        self.socket = context.socket(zmq.XPUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.topic = topic
        self.seq = 0
        self._encoder = msgspec.msgpack.Encoder()

    async def subscribed(self) -> bytes:
        """The next subscription message (``b"\\x01" + prefix``)."""
        return bytes(await self.socket.recv())

    def encode(self, *events: KVCacheEvent) -> bytes:
        return self._encoder.encode(KVEventBatch(ts=time.time(), events=list(events)))

    async def publish(self, *events: KVCacheEvent, seq: int | None = None) -> None:
        """Send one batch under the next sequence number (or ``seq``)."""
        seq = self.seq if seq is None else seq
        self.seq = max(self.seq, seq + 1)
        await self.socket.send_multipart([self.topic, seq.to_bytes(8, "big"), self.encode(*events)])

    def close(self) -> None:
        self.socket.close(linger=0)


def stored(
    hashes: list[int],
    tokens: list[int],
    medium: str | None,
    *,
    parent: int | None = None,
    block_size: int = BLOCK,
) -> BlockStored:
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=block_size,
        lora_id=None,
        medium=medium,
        lora_name=None,
    )


def removed(hashes: list[int], medium: str | None) -> BlockRemoved:
    return BlockRemoved(block_hashes=hashes, medium=medium)


def cumulative(tokens: int, tier: str) -> TierMatch:
    """What ``/query`` reports for ``tokens`` matched on one tier."""
    return {
        "gpu": TierMatch(tokens, tokens, tokens, tokens),
        "cpu": TierMatch(tokens, 0, tokens, tokens),
        "disk": TierMatch(tokens, 0, 0, tokens),
    }[tier]


@pytest.fixture
def context() -> Iterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
async def publisher(context: zmq.asyncio.Context) -> AsyncIterator[Publisher]:
    publisher = Publisher(context)
    yield publisher
    publisher.close()


@pytest.fixture
async def indexer(publisher: Publisher, tmp_path: Path) -> AsyncIterator[DynamoIndexer]:
    """An indexer subscribed to ``publisher`` as worker 1 (subscription established)."""
    with DynamoIndexer(
        tmp_path / "indexer",
        block_size=BLOCK,
        model_name=MODEL,
        workers={WORKER: publisher.endpoint},
    ).start() as indexer:
        with anyio.fail_after(WAIT):
            subscription = await publisher.subscribed()
        assert subscription == b"\x01", "the indexer subscribes to every topic"
        yield indexer


async def wait_match(
    indexer: DynamoIndexer, tokens: list[int], expected: TierMatch, worker: int = WORKER
) -> None:
    """Wait until ``tokens`` match ``expected`` on ``worker``; fails with the last match and
    the end of the indexer's log."""
    last = TierMatch()

    async def check() -> bool:
        nonlocal last
        last = await indexer.match(tokens, worker)
        return last == expected

    try:
        with anyio.fail_after(WAIT):
            await poll_until(check)
    except TimeoutError:
        raise AssertionError(
            f"expected {expected}, indexer still reports {last}; log:\n{indexer.log_tail()}"
        ) from None


async def sentinel(indexer: DynamoIndexer, publisher: Publisher) -> None:
    """Publish a GPU block under fresh tokens and wait until it is indexed: every batch
    published before it has then been consumed."""
    tokens = [50_000 + publisher.seq * BLOCK + i for i in range(BLOCK)]
    await publisher.publish(stored([10_000_000 + publisher.seq], tokens, "GPU"))
    await wait_match(indexer, tokens, cumulative(BLOCK, "gpu"))


async def test_cpu_blocks_match_under_the_cpu_count(
    indexer: DynamoIndexer, publisher: Publisher
) -> None:
    await publisher.publish(stored(PROMPT_HASHES, PROMPT, "CPU"))

    await wait_match(indexer, PROMPT, cumulative(len(PROMPT), "cpu"))
    answer = await indexer.query(PROMPT)
    assert answer["scores"] == {}, "the legacy flat scores count the GPU tier only"
    blocks = await indexer.indexed_blocks()
    assert {(b.storage_tier, b.block_hash) for b in blocks} == {
        ("host_pinned", h) for h in PROMPT_HASHES
    }
    # Only full blocks count; a longer query matches the stored prefix.
    assert await indexer.match(PROMPT[: BLOCK + 1], WORKER) == cumulative(BLOCK, "cpu")
    assert await indexer.match([*PROMPT, 1, 2, 3, 4], WORKER) == cumulative(len(PROMPT), "cpu")


async def test_unknown_prompt_matches_nothing(indexer: DynamoIndexer, publisher: Publisher) -> None:
    await publisher.publish(stored(PROMPT_HASHES, PROMPT, "CPU"))
    await wait_match(indexer, PROMPT, cumulative(len(PROMPT), "cpu"))

    answer = await indexer.query(OTHER)
    assert answer["instances"] == {}
    assert await indexer.match(OTHER, WORKER) == TierMatch()
    # The same tokens in another order are another prompt.
    assert await indexer.match(PROMPT[BLOCK:] + PROMPT[:BLOCK], WORKER) == TierMatch()


async def test_removed_blocks_are_no_longer_matched(
    indexer: DynamoIndexer, publisher: Publisher
) -> None:
    await publisher.publish(stored(PROMPT_HASHES, PROMPT, "CPU"))
    await wait_match(indexer, PROMPT, cumulative(len(PROMPT), "cpu"))

    await publisher.publish(removed(PROMPT_HASHES[-1:], "CPU"))
    await wait_match(indexer, PROMPT, cumulative(2 * BLOCK, "cpu"))
    await publisher.publish(removed(PROMPT_HASHES[:-1], "CPU"))
    await wait_match(indexer, PROMPT, TierMatch())
    assert await indexer.indexed_blocks() == []


async def test_removal_applies_to_its_own_medium_only(
    indexer: DynamoIndexer, publisher: Publisher
) -> None:
    await publisher.publish(stored(PROMPT_HASHES, PROMPT, "CPU"))
    await wait_match(indexer, PROMPT, cumulative(len(PROMPT), "cpu"))

    await publisher.publish(removed(PROMPT_HASHES, None))  # None is the GPU tier
    await publisher.publish(removed(PROMPT_HASHES, "DISK"))
    await sentinel(indexer, publisher)
    assert await indexer.match(PROMPT, WORKER) == cumulative(len(PROMPT), "cpu")


async def test_all_blocks_cleared_matches_nothing(
    indexer: DynamoIndexer, publisher: Publisher
) -> None:
    prompts = {
        medium: [i * 1000 + t for t in PROMPT] for i, medium in enumerate(("GPU", "CPU", "DISK"))
    }
    for i, (medium, tokens) in enumerate(prompts.items()):
        await publisher.publish(stored([0xB0 + 3 * i, 0xB1 + 3 * i, 0xB2 + 3 * i], tokens, medium))
    for medium, tokens in prompts.items():
        await wait_match(indexer, tokens, cumulative(len(tokens), medium.lower()))

    await publisher.publish(AllBlocksCleared())
    for tokens in prompts.values():
        await wait_match(indexer, tokens, TierMatch())
    assert await indexer.indexed_blocks() == []


@pytest.mark.parametrize(
    ("medium", "tier", "storage_tier"),
    [
        ("GPU", "gpu", "device"),
        (None, "gpu", "device"),
        ("CPU", "cpu", "host_pinned"),
        ("DISK", "disk", "disk"),
        ("STORAGE", "disk", "disk"),
    ],
)
async def test_medium_picks_the_tier(
    indexer: DynamoIndexer, publisher: Publisher, medium: str | None, tier: str, storage_tier: str
) -> None:
    await publisher.publish(stored(PROMPT_HASHES, PROMPT, medium))

    await wait_match(indexer, PROMPT, cumulative(len(PROMPT), tier))
    # /dump lists the tree in no fixed order.
    assert sorted(await indexer.indexed_blocks()) == [
        IndexedBlock(WORKER, storage_tier, h, parent)
        for h, parent in zip(PROMPT_HASHES, [None, *PROMPT_HASHES[:-1]], strict=True)
    ]


async def test_blocks_of_another_block_size_are_dropped(
    indexer: DynamoIndexer, publisher: Publisher
) -> None:
    await publisher.publish(stored([0xC1], PROMPT[: 2 * BLOCK], "GPU", block_size=2 * BLOCK))
    await sentinel(indexer, publisher)

    assert await indexer.match(PROMPT, WORKER) == TierMatch()
    assert "Block size must be" in indexer.log_tail(100_000)


async def test_a_block_is_placed_by_its_parent_and_found_by_its_tokens(
    indexer: DynamoIndexer, publisher: Publisher
) -> None:
    head, tail = PROMPT[:BLOCK], OTHER[:BLOCK]
    await publisher.publish(stored([0xD1], head, "GPU"))
    await publisher.publish(stored([0xD2], tail, "GPU", parent=0xD1))
    # A parent nothing stored: the whole store is dropped.
    await publisher.publish(stored([0xD3], OTHER[BLOCK : 2 * BLOCK], "GPU", parent=0xDEAD))

    await wait_match(indexer, head + tail, cumulative(2 * BLOCK, "gpu"))
    assert await indexer.match(tail, WORKER) == TierMatch(), "the tail is not a root block"
    assert await indexer.match(OTHER[BLOCK : 2 * BLOCK], WORKER) == TierMatch()
    assert 0xD3 not in {b.block_hash for b in await indexer.indexed_blocks()}


async def test_stale_sequence_numbers_are_dropped(
    indexer: DynamoIndexer, publisher: Publisher
) -> None:
    await publisher.publish(stored(PROMPT_HASHES[:1], PROMPT[:BLOCK], "GPU"), seq=5)
    await wait_match(indexer, PROMPT[:BLOCK], cumulative(BLOCK, "gpu"))

    # A restarted publisher counting from 0 again is ignored until it passes the last seq.
    await publisher.publish(stored([0xE1], OTHER[:BLOCK], "GPU"), seq=0)
    await sentinel(indexer, publisher)
    assert await indexer.match(OTHER[:BLOCK], WORKER) == TierMatch()


async def test_a_gap_is_replayed_from_the_router_endpoint(
    indexer: DynamoIndexer, context: zmq.asyncio.Context
) -> None:
    """With a registered replay endpoint, a first batch after seq 0 makes the indexer ask
    for ``[b"", start seq]`` on a DEALER; it takes vLLM's replies ``[b"", topic, seq,
    payload]`` until one with an empty payload."""
    live = Publisher(context, topic=b"kv")
    replay = context.socket(zmq.ROUTER)
    replay.setsockopt(zmq.LINGER, 0)
    replay_endpoint = f"tcp://127.0.0.1:{replay.bind_to_random_port('tcp://127.0.0.1')}"
    worker = 2
    try:
        await indexer.register(worker, live.endpoint, replay_endpoint=replay_endpoint)
        with anyio.fail_after(WAIT):
            assert await live.subscribed() == b"\x01"
            await live.publish(stored([0xF2], OTHER[:BLOCK], "GPU"), seq=3)
            identity, empty, start = await replay.recv_multipart()
        assert (empty, int.from_bytes(start, "big")) == (b"", 0)
        missed = live.encode(stored([0xF1], PROMPT[:BLOCK], "CPU"))
        await replay.send_multipart([identity, b"", b"kv", (0).to_bytes(8, "big"), missed])
        await replay.send_multipart([identity, b"", b"", (2**64 - 1).to_bytes(8, "big"), b""])

        await wait_match(indexer, PROMPT[:BLOCK], cumulative(BLOCK, "cpu"), worker)
        await wait_match(indexer, OTHER[:BLOCK], cumulative(BLOCK, "gpu"), worker)
    finally:
        replay.close(linger=0)
        live.close()
