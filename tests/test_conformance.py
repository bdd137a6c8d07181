"""One suite, two clients: the embedded ``CacheEngine`` and a ``RemoteCacheEngine``.

Every case runs twice, once on a :class:`~lmcache_async.CacheEngine` in this process and
once on a :class:`~lmcache_async.RemoteCacheEngine` connected to a real ``lmcache-async
serve`` process (started once for the module, as tests/rpc/test_sidecar.py starts them,
and emptied with ``clear()`` before each case). Both are written against the public API
only, and the few calls whose form differs (``freeze`` is a coroutine on the remote
client, ``stats`` a dict of plain data) go through :class:`Client`. A case that fails on
one client only is a real difference between the two.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, Final

import anyio
import pytest
import torch

from lmcache_async import (
    CacheEngine,
    EngineClosedError,
    EngineConfig,
    InvalidInputError,
    KVCacheClient,
    KVLayout,
    Promise,
    RemoteCacheEngine,
)
from tests.rpc.test_sidecar import CHUNK, Sidecar, Sidecars, wait_ready

pytestmark = pytest.mark.anyio

TIMEOUT: Final = 30.0
"""Seconds one case may take (a sidecar's start is bounded by ``wait_ready`` itself)."""

BLOCK_SIZE: Final = 16
LAYOUT: Final = KVLayout.vllm_flash_attn(
    num_layers=3, block_size=BLOCK_SIZE, num_kv_heads=2, head_size=8, dtype=torch.float16
)
MODEL: Final = "conformance"
CONFIG: Final = EngineConfig(chunk_size=CHUNK, max_local_cpu_size=0.02)
"""The embedded engine's settings: those the sidecar is started with (tests/rpc's
SERVE_FLAGS: chunk size CHUNK, 0.02 GB of host memory)."""

COUNTERS: Final = (
    "store_requests",
    "retrieve_requests",
    "lookup_requests",
    "stored_tokens",
    "retrieved_tokens",
    "lookup_tokens",
    "lookup_hit_tokens",
)


# -- helpers ----------------------------------------------------------------------------------


def prompt(length: int, salt: int) -> list[int]:
    """Token ids; another ``salt`` gives another prompt from its first chunk on."""
    return [(i * 7919 + 13 + 104_729 * salt) % 50_000 for i in range(length)]


def blocks_for(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK_SIZE)


def kv_for(num_tokens: int, seed: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Random KV caches holding ``num_tokens`` tokens, and the slots 0..num_tokens-1."""
    generator = torch.Generator().manual_seed(seed)
    kv = LAYOUT.allocate_kv_caches(blocks_for(num_tokens), generator=generator)
    return kv, torch.arange(num_tokens)


def fresh(num_blocks: int) -> list[torch.Tensor]:
    """Zeroed KV caches to retrieve into."""
    return LAYOUT.allocate_kv_caches(num_blocks, random=False)


def payload_of(kv_caches: list[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
    """The KV bytes of ``slots``, gathered in the layout's payload form."""
    out = torch.empty(LAYOUT.payload_shape(len(slots)), dtype=LAYOUT.dtype)
    LAYOUT.gather(kv_caches, slots, out)
    return out


def raw(tensor: torch.Tensor) -> bytes:
    """A tensor's exact bytes (bit-for-bit, NaN patterns and signed zeros included)."""
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


def untouched(kv_caches: list[torch.Tensor], written: torch.Tensor) -> bool:
    """Whether every slot of ``kv_caches`` outside ``written`` is still zero bytes."""
    every = torch.ones(kv_caches[0].shape[1] * BLOCK_SIZE, dtype=torch.bool)  # [2, blocks, ...]
    every[written] = False
    rest = torch.nonzero(every).flatten()
    return not rest.numel() or not any(raw(payload_of(kv_caches, rest)))


def mask_from(num_tokens: int, start: int) -> torch.Tensor:
    """``F…FT…T``: True from ``start`` on."""
    mask = torch.zeros(num_tokens, dtype=torch.bool)
    mask[start:] = True
    return mask


def mask_between(num_tokens: int, start: int, end: int) -> torch.Tensor:
    mask = torch.zeros(num_tokens, dtype=torch.bool)
    mask[start:end] = True
    return mask


@dataclasses.dataclass
class Client:
    """One of the two clients, behind the calls whose form differs between them."""

    kind: str
    engine: CacheEngine | RemoteCacheEngine

    @property
    def api(self) -> KVCacheClient:
        """The interface both share."""
        return self.engine

    async def freeze(self, enabled: bool) -> None:
        """Switch freeze mode (sync on the embedded engine, a request on the remote one)."""
        if isinstance(self.engine, RemoteCacheEngine):
            assert await self.engine.freeze(enabled), "the sidecar did not answer FREEZE"
        else:
            self.engine.freeze(enabled)

    async def stats(self) -> dict[str, Any]:
        """The engine's stats as a dict of the fields of ``EngineStats``."""
        if isinstance(self.engine, RemoteCacheEngine):
            engine = (await self.engine.stats())["engine"]
            assert engine is not None, "the sidecar did not answer STATS"
            return dict(engine)
        stats = self.engine.stats()
        return {f.name: getattr(stats, f.name) for f in dataclasses.fields(stats)}

    async def counters(self) -> dict[str, int]:
        stats = await self.stats()
        return {name: int(stats[name]) for name in COUNTERS}


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecar]:
    """One ``lmcache-async serve`` for the module (readiness is awaited by ``client``)."""
    short = Path(tempfile.mkdtemp(prefix="lmc-cf-", dir="/tmp"))  # ipc paths: 107 bytes
    launcher = Sidecars(tmp_path_factory.mktemp("conformance-logs"))
    try:
        yield launcher.start(f"ipc://{short}/conformance.sock")
    finally:
        launcher.stop_all()
        shutil.rmtree(short, ignore_errors=True)


@pytest.fixture(params=["embedded", pytest.param("sidecar", marks=pytest.mark.subprocess)])
def target(request: pytest.FixtureRequest) -> Sidecar | None:
    """None for the embedded engine, else the module's sidecar (started on first use)."""
    if request.param == "embedded":
        return None
    started: Sidecar = request.getfixturevalue("sidecar")
    return started


@pytest.fixture
async def client(target: Sidecar | None) -> AsyncIterator[Client]:
    """The client under test, its cache emptied and unfrozen."""
    if target is None:
        async with CacheEngine.open(CONFIG, LAYOUT, model_name=MODEL) as engine:
            yield Client("embedded", engine)
        return
    await wait_ready(target)  # bounded by its own fail_after (a cold start imports torch)
    async with RemoteCacheEngine.connect(
        target.url, LAYOUT, model_name=MODEL, timeout=10
    ) as remote:
        client = Client("sidecar", remote)
        with anyio.fail_after(TIMEOUT):
            await client.freeze(False)
            await remote.clear()
        yield client
    assert target.alive(), f"the sidecar died:\n{target.log()[-3000:]}"


# -- store and retrieve -----------------------------------------------------------------------


@pytest.mark.parametrize("num_tokens", [4 * CHUNK, 3 * CHUNK + 5], ids=["full", "partial"])
async def test_a_round_trip_is_bit_exact_into_fresh_caches(client: Client, num_tokens: int) -> None:
    tokens = prompt(num_tokens, 1)
    kv, slots = kv_for(num_tokens, seed=11)
    # Other slots in a larger cache: the retrieve must follow its own slot_mapping.
    target = fresh(2 * blocks_for(num_tokens))
    generator = torch.Generator().manual_seed(3)
    other = torch.randperm(target[0].shape[1] * BLOCK_SIZE, generator=generator)[:num_tokens]
    with anyio.fail_after(TIMEOUT):
        assert await client.api.store(tokens, kv_caches=kv, slot_mapping=slots) == num_tokens
        assert await client.api.lookup(tokens) == num_tokens
        mask = await client.api.retrieve(tokens, kv_caches=target, slot_mapping=other)
    assert mask.dtype == torch.bool and mask.device.type == "cpu"
    assert mask.shape == (num_tokens,) and bool(mask.all())
    assert raw(payload_of(target, other)) == raw(payload_of(kv, slots))
    assert untouched(target, other)


async def test_a_round_trip_by_block_hashes_is_bit_exact(client: Client) -> None:
    num_tokens = 3 * CHUNK
    hashes = [0x1234, 0x5678_9ABC, 42]
    offsets = [CHUNK, 2 * CHUNK, 3 * CHUNK]
    kv, slots = kv_for(num_tokens, seed=12)
    target = fresh(blocks_for(num_tokens))
    with anyio.fail_after(TIMEOUT):
        stored = await client.api.store(
            hashes=hashes, offsets=offsets, kv_caches=kv, slot_mapping=slots
        )
        assert stored == num_tokens
        assert await client.api.lookup(hashes=hashes, offsets=offsets) == num_tokens
        assert await client.api.lookup(hashes=[0x1234, 7], offsets=offsets[:2]) == CHUNK
        mask = await client.api.retrieve(
            hashes=hashes, offsets=offsets, kv_caches=target, slot_mapping=slots
        )
    assert bool(mask.all())
    assert raw(payload_of(target, slots)) == raw(payload_of(kv, slots))


# -- masks and negative slots -----------------------------------------------------------------


async def test_a_store_mask_stores_only_the_chunks_from_its_first_true(client: Client) -> None:
    num_tokens = 4 * CHUNK
    tokens = prompt(num_tokens, 2)
    kv, slots = kv_for(num_tokens, seed=21)
    target = fresh(blocks_for(num_tokens))
    with anyio.fail_after(TIMEOUT):
        stored = await client.api.store(
            tokens, kv_caches=kv, slot_mapping=slots, mask=mask_from(num_tokens, 2 * CHUNK)
        )
        assert stored == 2 * CHUNK
        assert (await client.stats())["cached_chunks"] == 2
        assert await client.api.lookup(tokens) == 0  # the prefix's first chunks are missing
        nothing = await client.api.retrieve(tokens, kv_caches=target, slot_mapping=slots)
        assert not nothing.any()
        assert untouched(target, torch.tensor([], dtype=torch.long))
        loaded = await client.api.retrieve(
            tokens, kv_caches=target, slot_mapping=slots, mask=mask_from(num_tokens, 2 * CHUNK)
        )
    assert torch.equal(loaded, mask_from(num_tokens, 2 * CHUNK))
    tail = slots[2 * CHUNK :]
    assert raw(payload_of(target, tail)) == raw(payload_of(kv, tail))
    assert untouched(target, tail)


async def test_a_retrieve_mask_loads_only_the_chunks_from_its_first_true(client: Client) -> None:
    num_tokens = 4 * CHUNK + 3
    tokens = prompt(num_tokens, 3)
    kv, slots = kv_for(num_tokens, seed=31)
    target = fresh(blocks_for(num_tokens))
    with anyio.fail_after(TIMEOUT):
        assert await client.api.store(tokens, kv_caches=kv, slot_mapping=slots) == num_tokens
        loaded = await client.api.retrieve(
            tokens, kv_caches=target, slot_mapping=slots, mask=mask_from(num_tokens, CHUNK)
        )
    assert torch.equal(loaded, mask_from(num_tokens, CHUNK))
    part = slots[CHUNK:]
    assert raw(payload_of(target, part)) == raw(payload_of(kv, part))
    assert untouched(target, part)  # the caller's first chunk is not overwritten


@pytest.mark.parametrize("operation", ["store", "retrieve"])
async def test_a_mask_off_a_chunk_boundary_is_refused(client: Client, operation: str) -> None:
    num_tokens = 3 * CHUNK
    tokens = prompt(num_tokens, 4)
    kv, slots = kv_for(num_tokens, seed=41)
    call = client.api.store if operation == "store" else client.api.retrieve
    with anyio.fail_after(TIMEOUT):
        for bad in (mask_from(num_tokens, CHUNK + 3), mask_from(num_tokens, 5)):
            with pytest.raises(InvalidInputError):
                await call(tokens, kv_caches=kv, slot_mapping=slots, mask=bad)
        with pytest.raises(InvalidInputError):  # not F…FT…T
            await call(
                tokens, kv_caches=kv, slot_mapping=slots, mask=mask_between(num_tokens, 0, CHUNK)
            )
        with pytest.raises(InvalidInputError):  # another length
            await call(tokens, kv_caches=kv, slot_mapping=slots, mask=mask_from(CHUNK, 0))
        assert await client.api.lookup(tokens) == 0
        assert (await client.stats())["cached_chunks"] == 0


async def test_a_negative_slot_stops_the_store_at_its_chunk(client: Client) -> None:
    num_tokens = 4 * CHUNK
    tokens = prompt(num_tokens, 5)
    kv, slots = kv_for(num_tokens, seed=51)
    holed = slots.clone()
    holed[2 * CHUNK + 4] = -1
    with anyio.fail_after(TIMEOUT):
        assert await client.api.store(tokens, kv_caches=kv, slot_mapping=holed) == 2 * CHUNK
        assert await client.api.lookup(tokens) == 2 * CHUNK
        assert (await client.stats())["cached_chunks"] == 2


async def test_negative_slots_in_a_retrieve_are_not_written(client: Client) -> None:
    num_tokens = 3 * CHUNK + 5
    tokens = prompt(num_tokens, 6)
    kv, slots = kv_for(num_tokens, seed=61)
    holes = torch.tensor([3, CHUNK + 7, 3 * CHUNK + 1])
    holed = slots.clone()
    holed[holes] = -1
    target = fresh(blocks_for(num_tokens))
    with anyio.fail_after(TIMEOUT):
        assert await client.api.store(tokens, kv_caches=kv, slot_mapping=slots) == num_tokens
        loaded = await client.api.retrieve(tokens, kv_caches=target, slot_mapping=holed)
    expected = torch.ones(num_tokens, dtype=torch.bool)
    expected[holes] = False
    assert torch.equal(loaded, expected)
    written = holed[expected]
    assert raw(payload_of(target, written)) == raw(payload_of(kv, slots[expected]))
    assert untouched(target, written)  # the holes' own slots stay zero


# -- lookups, pins, prefetch ------------------------------------------------------------------


async def test_lookup_counts_the_cached_prefix(client: Client) -> None:
    num_tokens = 3 * CHUNK + 5
    tokens = prompt(num_tokens, 7)
    kv, slots = kv_for(num_tokens, seed=71)
    with anyio.fail_after(TIMEOUT):
        assert await client.api.lookup(tokens) == 0
        assert await client.api.store(tokens, kv_caches=kv, slot_mapping=slots) == num_tokens
        assert await client.api.lookup(tokens) == num_tokens
        assert await client.api.lookup(tokens[: 2 * CHUNK]) == 2 * CHUNK
        assert await client.api.lookup(tokens[: 2 * CHUNK + 9]) == 2 * CHUNK
        assert await client.api.lookup(tokens + prompt(40, 8)) == 3 * CHUNK
        changed = list(tokens)
        changed[CHUNK + 1] += 1
        assert await client.api.lookup(changed) == CHUNK
        assert await client.api.lookup(torch.tensor(tokens)) == num_tokens
        assert await client.api.lookup(prompt(num_tokens, 9)) == 0
        assert await client.api.lookup([]) == 0


async def test_pins_are_taken_by_a_lookup_and_released_by_unpin(client: Client) -> None:
    num_tokens = 3 * CHUNK + 5
    tokens = prompt(num_tokens, 10)
    kv, slots = kv_for(num_tokens, seed=101)
    with anyio.fail_after(TIMEOUT):
        assert await client.api.store(tokens, kv_caches=kv, slot_mapping=slots) == num_tokens
        assert await client.api.lookup(tokens, lookup_id=7, pin=True) == num_tokens
        pinned = await client.stats()
        assert (pinned["pinned_chunks"], pinned["active_lookup_ids"]) == (4, 1)
        assert (
            await client.api.lookup(tokens[: 2 * CHUNK], lookup_id="eight", pin=True) == 2 * CHUNK
        )
        both = await client.stats()
        assert both["active_lookup_ids"] == 2
        await client.api.lookup_unpin(7)
        one = await client.stats()
        assert (one["pinned_chunks"], one["active_lookup_ids"]) == (2, 1)
        await client.api.lookup_unpin("eight")
        await client.api.lookup_unpin("never-pinned")  # a no-op
        none = await client.stats()
        assert (none["pinned_chunks"], none["active_lookup_ids"]) == (0, 0)
        with pytest.raises(InvalidInputError):
            await client.api.lookup(tokens, pin=True)  # a pin needs a lookup_id
        assert await client.api.lookup(tokens) == num_tokens  # unpinned is still cached


async def test_a_retrieve_with_the_lookup_id_releases_its_pins(client: Client) -> None:
    num_tokens = 4 * CHUNK
    tokens = prompt(num_tokens, 11)
    kv, slots = kv_for(num_tokens, seed=111)
    target = fresh(blocks_for(num_tokens))
    with anyio.fail_after(TIMEOUT):
        assert await client.api.store(tokens, kv_caches=kv, slot_mapping=slots) == num_tokens
        assert await client.api.lookup(tokens, lookup_id=21, pin=True) == num_tokens
        assert (await client.stats())["pinned_chunks"] == 4
        mask = await client.api.retrieve(tokens, kv_caches=target, slot_mapping=slots, lookup_id=21)
        after = await client.stats()
    assert bool(mask.all())
    assert raw(payload_of(target, slots)) == raw(payload_of(kv, slots))
    assert (after["pinned_chunks"], after["active_lookup_ids"]) == (0, 0)


async def test_a_prefetch_then_a_retrieve_with_its_lookup_id(client: Client) -> None:
    num_tokens = 3 * CHUNK + 5
    tokens = prompt(num_tokens, 12)
    kv, slots = kv_for(num_tokens, seed=121)
    target = fresh(blocks_for(num_tokens))
    with anyio.fail_after(TIMEOUT):
        assert await client.api.prefetch(prompt(num_tokens, 13), lookup_id="none") == 0
        assert await client.api.store(tokens, kv_caches=kv, slot_mapping=slots) == num_tokens
        assert await client.api.prefetch(tokens, lookup_id="p") == num_tokens
        mask = await client.api.retrieve(
            tokens, kv_caches=target, slot_mapping=slots, lookup_id="p"
        )
        after = await client.stats()
    assert bool(mask.all())
    assert raw(payload_of(target, slots)) == raw(payload_of(kv, slots))
    assert (after["pinned_chunks"], after["active_lookup_ids"]) == (0, 0)


async def test_a_promise_pins_what_it_counts_until_the_retrieve(client: Client) -> None:
    num_tokens = 3 * CHUNK + 5
    tokens = prompt(num_tokens, 14)
    kv, slots = kv_for(num_tokens, seed=141)
    target = fresh(blocks_for(num_tokens))
    with anyio.fail_after(TIMEOUT):
        nothing = await client.api.promise(prompt(num_tokens, 15), lookup_id="q0")
        assert nothing == Promise(0, False)
        assert await client.api.store(tokens, kv_caches=kv, slot_mapping=slots) == num_tokens
        promised = await client.api.promise(tokens, lookup_id="q", computed_tokens=CHUNK)
        assert promised == Promise(num_tokens, False)
        assert (await client.stats())["pinned_chunks"] == 4
        mask = await client.api.retrieve(
            tokens, kv_caches=target, slot_mapping=slots, lookup_id="q"
        )
        await client.api.lookup_unpin("q0")
        after = await client.stats()
    assert bool(mask.all())
    assert raw(payload_of(target, slots)) == raw(payload_of(kv, slots))
    assert (after["pinned_chunks"], after["active_lookup_ids"]) == (0, 0)


# -- switches ---------------------------------------------------------------------------------


async def test_clear_drops_everything_and_lookups_miss(client: Client) -> None:
    first, second = prompt(2 * CHUNK, 14), prompt(3 * CHUNK + 5, 15)
    kv, slots = kv_for(3 * CHUNK + 5, seed=141)
    target = fresh(blocks_for(3 * CHUNK + 5))
    with anyio.fail_after(TIMEOUT):
        assert await client.api.store(first, kv_caches=kv, slot_mapping=slots[: 2 * CHUNK]) > 0
        assert await client.api.store(second, kv_caches=kv, slot_mapping=slots) > 0
        assert await client.api.lookup(second, lookup_id="held", pin=True) == 3 * CHUNK + 5
        assert await client.api.clear() == 2 + 4
        assert await client.api.lookup(first) == 0
        assert await client.api.lookup(second) == 0
        mask = await client.api.retrieve(second, kv_caches=target, slot_mapping=slots)
        stats = await client.stats()
        assert await client.api.clear() == 0
    assert not mask.any()
    assert untouched(target, torch.tensor([], dtype=torch.long))
    assert (stats["cached_chunks"], stats["pinned_chunks"]) == (0, 0)


async def test_nothing_is_stored_while_frozen(client: Client) -> None:
    num_tokens = 2 * CHUNK
    kept, frozen_out = prompt(num_tokens, 16), prompt(num_tokens, 17)
    kv, slots = kv_for(num_tokens, seed=161)
    target = fresh(blocks_for(num_tokens))
    with anyio.fail_after(TIMEOUT):
        assert await client.api.store(kept, kv_caches=kv, slot_mapping=slots) == num_tokens
        await client.freeze(True)
        try:
            assert (await client.stats())["frozen"] is True
            assert await client.api.store(frozen_out, kv_caches=kv, slot_mapping=slots) == 0
            assert await client.api.lookup(frozen_out) == 0
            assert await client.api.lookup(kept) == num_tokens  # reads go on
            mask = await client.api.retrieve(kept, kv_caches=target, slot_mapping=slots)
            assert bool(mask.all())
        finally:
            await client.freeze(False)
        assert (await client.stats())["frozen"] is False
        assert await client.api.store(frozen_out, kv_caches=kv, slot_mapping=slots) == num_tokens
        assert await client.api.lookup(frozen_out) == num_tokens
    assert raw(payload_of(target, slots)) == raw(payload_of(kv, slots))


async def test_stats_count_the_traffic(client: Client) -> None:
    num_tokens = 3 * CHUNK + 5
    tokens, missing = prompt(num_tokens, 18), prompt(2 * CHUNK, 19)
    kv, slots = kv_for(num_tokens, seed=181)
    target = fresh(blocks_for(num_tokens))
    with anyio.fail_after(TIMEOUT):
        before = await client.counters()
        assert await client.api.store(tokens, kv_caches=kv, slot_mapping=slots) == num_tokens
        assert await client.api.store(tokens, kv_caches=kv, slot_mapping=slots) == num_tokens
        assert await client.api.lookup(tokens) == num_tokens
        assert await client.api.lookup(missing) == 0
        mask = await client.api.retrieve(tokens, kv_caches=target, slot_mapping=slots)
        assert bool(mask.all())
        after = await client.counters()
        stats = await client.stats()
    delta = {name: after[name] - before[name] for name in COUNTERS}
    assert delta == {
        "store_requests": 2,
        "retrieve_requests": 1,
        "lookup_requests": 2,
        "stored_tokens": 2 * num_tokens,
        "retrieved_tokens": num_tokens,
        "lookup_tokens": num_tokens + 2 * CHUNK,
        "lookup_hit_tokens": num_tokens,
    }
    assert stats["cached_chunks"] == 4
    assert stats["healthy"] is True and stats["frozen"] is False


# -- bad input and a closed client ------------------------------------------------------------


BadCall = Callable[[KVCacheClient, list[int], list[torch.Tensor], torch.Tensor], Awaitable[object]]

BAD_STORES: Final[dict[str, BadCall]] = {
    "tokens and hashes": lambda c, t, kv, s: c.store(
        t, hashes=[1, 2], offsets=[CHUNK, 2 * CHUNK], kv_caches=kv, slot_mapping=s
    ),
    "hashes without offsets": lambda c, t, kv, s: c.store(
        hashes=[1, 2], kv_caches=kv, slot_mapping=s
    ),
    "offsets without hashes": lambda c, t, kv, s: c.store(
        t, offsets=[CHUNK, 2 * CHUNK], kv_caches=kv, slot_mapping=s
    ),
    "2-D tokens": lambda c, t, kv, s: c.store(
        torch.tensor(t).view(2, -1), kv_caches=kv, slot_mapping=s
    ),
    "short slot_mapping": lambda c, t, kv, s: c.store(t, kv_caches=kv, slot_mapping=s[:-3]),
    "long slot_mapping": lambda c, t, kv, s: c.store(
        t, kv_caches=kv, slot_mapping=torch.arange(len(t) + 1)
    ),
    "2-D slot_mapping": lambda c, t, kv, s: c.store(t, kv_caches=kv, slot_mapping=s.view(2, -1)),
    "negative token": lambda c, t, kv, s: c.store([-1, *t[1:]], kv_caches=kv, slot_mapping=s),
}

BAD_READS: Final[dict[str, BadCall]] = {
    "retrieve: tokens and hashes": lambda c, t, kv, s: c.retrieve(
        t, hashes=[1, 2], offsets=[CHUNK, 2 * CHUNK], kv_caches=kv, slot_mapping=s
    ),
    "retrieve: hashes without offsets": lambda c, t, kv, s: c.retrieve(
        hashes=[1, 2], kv_caches=kv, slot_mapping=s
    ),
    "retrieve: 2-D tokens": lambda c, t, kv, s: c.retrieve(
        torch.tensor(t).view(2, -1), kv_caches=kv, slot_mapping=s
    ),
    "retrieve: short slot_mapping": lambda c, t, kv, s: c.retrieve(
        t, kv_caches=kv, slot_mapping=s[:-3]
    ),
    "lookup: tokens and hashes": lambda c, t, kv, s: c.lookup(
        t, hashes=[1, 2], offsets=[CHUNK, 2 * CHUNK]
    ),
    "lookup: hashes without offsets": lambda c, t, kv, s: c.lookup(hashes=[1, 2]),
    "lookup: 2-D tokens": lambda c, t, kv, s: c.lookup(torch.tensor(t).view(2, -1)),
    "prefetch: hashes without offsets": lambda c, t, kv, s: c.prefetch(
        hashes=[1, 2], lookup_id="x"
    ),
    "prefetch: 2-D tokens": lambda c, t, kv, s: c.prefetch(
        torch.tensor(t).view(2, -1), lookup_id="x"
    ),
}


@pytest.mark.parametrize("case", [*BAD_STORES, *BAD_READS])
async def test_bad_input_raises_and_stores_nothing(client: Client, case: str) -> None:
    num_tokens = 2 * CHUNK
    tokens = prompt(num_tokens, 20)
    kv, slots = kv_for(num_tokens, seed=201)
    call = BAD_STORES.get(case) or BAD_READS[case]
    with anyio.fail_after(TIMEOUT):
        before = await client.counters()
        with pytest.raises(InvalidInputError):
            await call(client.api, tokens, kv, slots)
        after = await client.counters()
        stats = await client.stats()
        assert await client.api.lookup(tokens) == 0
        assert await client.api.lookup(hashes=[1, 2], offsets=[CHUNK, 2 * CHUNK]) == 0
    assert stats["cached_chunks"] == 0
    assert after == before, "a refused call was counted as traffic"


async def test_a_closed_client_raises_engine_closed(client: Client) -> None:
    num_tokens = 2 * CHUNK
    tokens = prompt(num_tokens, 21)
    kv, slots = kv_for(num_tokens, seed=211)
    api = client.api
    with anyio.fail_after(TIMEOUT):
        assert await api.store(tokens, kv_caches=kv, slot_mapping=slots) == num_tokens
        assert (api.closed, api.is_healthy()) == (False, True)
        await api.aclose()
        await api.aclose()  # idempotent
        assert (api.closed, api.is_healthy()) == (True, False)
        calls: dict[str, Callable[[], Awaitable[object]]] = {
            "store": lambda: api.store(tokens, kv_caches=kv, slot_mapping=slots),
            "retrieve": lambda: api.retrieve(tokens, kv_caches=kv, slot_mapping=slots),
            "lookup": lambda: api.lookup(tokens),
            "lookup with a pin": lambda: api.lookup(tokens, lookup_id=1, pin=True),
            "prefetch": lambda: api.prefetch(tokens, lookup_id=1),
            "lookup_unpin": lambda: api.lookup_unpin(1),
            "clear": api.clear,
            "freeze": lambda: client.freeze(True),
        }
        answered = []
        for name, call in calls.items():
            try:
                await call()
            except EngineClosedError:
                continue
            answered.append(name)
    assert not answered, f"{client.kind}: closed, yet these did not raise EngineClosedError"


async def test_stats_of_a_closed_client(client: Client) -> None:
    """The one intended difference: an embedded engine's stats stay readable after close
    (they show what it left: no live memory, not healthy); a sidecar's client cannot ask
    a closed link."""
    await client.api.aclose()
    with anyio.fail_after(TIMEOUT):
        if isinstance(client.engine, RemoteCacheEngine):
            with pytest.raises(EngineClosedError):
                await client.stats()
        else:
            stats = client.engine.stats()
            assert not stats.healthy
            assert stats.pool.num_objects == 0


# -- edges ------------------------------------------------------------------------------------


async def test_a_mask_that_skips_every_chunk_stores_and_loads_nothing(client: Client) -> None:
    num_tokens = 2 * CHUNK
    tokens = prompt(num_tokens, 23)
    kv, slots = kv_for(num_tokens, seed=231)
    none = torch.zeros(num_tokens, dtype=torch.bool)
    with anyio.fail_after(TIMEOUT):
        before = await client_errors(client)
        assert await client.api.store(tokens, kv_caches=kv, slot_mapping=slots, mask=none) == 0
        assert await client.api.lookup(tokens) == 0
        mask = await client.api.retrieve(tokens, kv_caches=kv, slot_mapping=slots, mask=none)
        assert await client_errors(client) == before  # answered, not failed
    assert not mask.any()


async def client_errors(client: Client) -> int:
    """Requests a sidecar client saw fail or time out (0 for the embedded engine)."""
    if isinstance(client.engine, RemoteCacheEngine):
        counters = (await client.engine.stats())["client"]
        return int(counters["timeouts"]) + int(counters["unavailable"])
    return 0


async def test_an_empty_prompt_moves_nothing(client: Client) -> None:
    kv = fresh(1)
    empty = torch.zeros(0, dtype=torch.long)
    with anyio.fail_after(TIMEOUT):
        assert await client.api.store([], kv_caches=kv, slot_mapping=empty) == 0
        mask = await client.api.retrieve([], kv_caches=kv, slot_mapping=empty)
        assert await client.api.lookup([]) == 0
        assert await client.api.prefetch([], lookup_id="empty") == 0
        assert (await client.stats())["cached_chunks"] == 0
    assert mask.dtype == torch.bool and mask.shape == (0,)


async def test_tier_names_are_checked(client: Client) -> None:
    num_tokens = 2 * CHUNK
    tokens = prompt(num_tokens, 22)
    kv, slots = kv_for(num_tokens, seed=221)
    with anyio.fail_after(TIMEOUT):
        with pytest.raises(InvalidInputError):
            await client.api.store(
                tokens, kv_caches=kv, slot_mapping=slots, store_location=["disk"]
            )
        with pytest.raises(InvalidInputError):
            await client.api.lookup(tokens, search_range=["redis"])
        with pytest.raises(InvalidInputError):
            await client.api.clear(["nowhere"])
        assert (await client.stats())["cached_chunks"] == 0
        stored = await client.api.store(
            tokens, kv_caches=kv, slot_mapping=slots, store_location=["cpu"]
        )
        assert stored == num_tokens
        assert await client.api.lookup(tokens, search_range=["cpu"]) == num_tokens
        assert await client.api.clear(["cpu"]) == 2
        assert await client.api.lookup(tokens) == 0


# -- tenants ----------------------------------------------------------------------------------


async def test_a_tenants_prompt_is_found_and_loaded_by_that_tenant_only(client: Client) -> None:
    num_tokens = 3 * CHUNK + 5
    tokens = prompt(num_tokens, 30)
    kv, slots = kv_for(num_tokens, seed=301)
    with anyio.fail_after(TIMEOUT):
        stored = await client.api.store(tokens, kv_caches=kv, slot_mapping=slots, tenant="a")
        assert stored == num_tokens
        assert await client.api.lookup(tokens, tenant="a") == num_tokens
        assert await client.api.lookup(tokens[: 2 * CHUNK], tenant="a") == 2 * CHUNK
        for other in ("b", "", None):
            assert await client.api.lookup(tokens, tenant=other) == 0, other
            assert await client.api.prefetch(tokens, lookup_id="o", tenant=other) == 0, other
            target = fresh(blocks_for(num_tokens))
            mask = await client.api.retrieve(
                tokens, kv_caches=target, slot_mapping=slots, tenant=other
            )
            assert not mask.any(), other
            assert untouched(target, torch.tensor([], dtype=torch.long)), other
        await client.api.lookup_unpin("o")
        assert await client.api.lookup(tokens, lookup_id="p", pin=True, tenant="a") == num_tokens
        assert (await client.stats())["pinned_chunks"] == 4
        target = fresh(blocks_for(num_tokens))
        mask = await client.api.retrieve(
            tokens, kv_caches=target, slot_mapping=slots, lookup_id="p", tenant="a"
        )
        after = await client.stats()
    assert bool(mask.all())
    assert raw(payload_of(target, slots)) == raw(payload_of(kv, slots))
    assert (after["pinned_chunks"], after["active_lookup_ids"], after["cached_chunks"]) == (0, 0, 4)


async def test_two_tenants_keep_their_own_kv_of_one_prompt(client: Client) -> None:
    num_tokens = 2 * CHUNK + 3
    tokens = prompt(num_tokens, 31)
    kv_a, slots = kv_for(num_tokens, seed=311)
    kv_b, _ = kv_for(num_tokens, seed=312)
    kv_own, _ = kv_for(num_tokens, seed=313)
    with anyio.fail_after(TIMEOUT):
        for tenant, kv in (("a", kv_a), ("b", kv_b), (None, kv_own)):
            stored = await client.api.store(tokens, kv_caches=kv, slot_mapping=slots, tenant=tenant)
            assert stored == num_tokens, tenant
        assert (await client.stats())["cached_chunks"] == 3 * 3
        for tenant, kv in (("a", kv_a), ("b", kv_b), (None, kv_own)):
            target = fresh(blocks_for(num_tokens))
            mask = await client.api.retrieve(
                tokens, kv_caches=target, slot_mapping=slots, tenant=tenant
            )
            assert bool(mask.all()), tenant
            assert raw(payload_of(target, slots)) == raw(payload_of(kv, slots)), tenant
        # By block hashes too: the tenant keys them as it keys tokens.
        hashes, offsets = [11, 22], [CHUNK, 2 * CHUNK]
        stored = await client.api.store(
            hashes=hashes,
            offsets=offsets,
            kv_caches=kv_a,
            slot_mapping=slots[: 2 * CHUNK],
            tenant="a",
        )
        assert stored == 2 * CHUNK
        assert await client.api.lookup(hashes=hashes, offsets=offsets, tenant="a") == 2 * CHUNK
        assert await client.api.lookup(hashes=hashes, offsets=offsets, tenant="b") == 0
        assert await client.api.lookup(hashes=hashes, offsets=offsets) == 0


BAD_TENANTS: Final = [
    pytest.param(7, id="int"),
    pytest.param(b"a", id="bytes"),
    pytest.param("x" * 257, id="too-long"),
    pytest.param("\ud800", id="not-unicode"),
]


@pytest.mark.parametrize("bad", BAD_TENANTS)
async def test_a_bad_tenant_raises_and_stores_nothing(client: Client, bad: Any) -> None:
    num_tokens = 2 * CHUNK
    tokens = prompt(num_tokens, 32)
    kv, slots = kv_for(num_tokens, seed=321)
    calls: list[Callable[[], Awaitable[object]]] = [
        lambda: client.api.store(tokens, kv_caches=kv, slot_mapping=slots, tenant=bad),
        lambda: client.api.retrieve(tokens, kv_caches=kv, slot_mapping=slots, tenant=bad),
        lambda: client.api.lookup(tokens, tenant=bad),
        lambda: client.api.prefetch(tokens, lookup_id="bad", tenant=bad),
    ]
    with anyio.fail_after(TIMEOUT):
        for call in calls:
            with pytest.raises(InvalidInputError, match="tenant"):
                await call()
        stats = await client.stats()
        assert (stats["cached_chunks"], stats["pinned_chunks"]) == (0, 0)
        assert await client.api.lookup(tokens) == 0
