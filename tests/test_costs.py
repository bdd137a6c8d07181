"""The load-or-recompute model: tier speeds fit to reads, and the decision for given tier
and prefill speeds (fast tiers load everything, a tier slower than recomputing loads
nothing, a slow tail is cut, small runs weigh their latency, an unknown prefill speed
loads everything), and its counts."""

from __future__ import annotations

import math

import pytest

from lmcache_async.engine.costs import LoadCosts, LoadDecision, Run, TierSpeed
from lmcache_async.errors import InvalidInputError

CHUNK = 256
TOKEN_BYTES = 128 * 1024  # a mid-size model's KV per token
MB = 1e6
# A chunk (256 tokens, 32 MiB) recomputes in 51 ms at 5k tokens/s, in 12.8 ms at 20k.


def run(tier: str, chunks: float) -> Run:
    tokens = int(chunks * CHUNK)
    return Run(tier, tokens, tokens * TOKEN_BYTES)


def costs(**speeds: tuple[float, float]) -> LoadCosts:
    """A model whose tiers read at ``(bytes/s, latency s)``: two exact samples each."""
    model = LoadCosts(["cpu", *speeds], chunk_size=CHUNK)
    for tier, (throughput, latency) in speeds.items():
        model.observe(tier, 0, latency)
        model.observe(tier, 1 << 20, latency + (1 << 20) / throughput)
    return model


def test_two_samples_give_the_exact_line() -> None:
    speed = TierSpeed()
    speed.observe(0, 0.002)
    speed.observe(10_000_000, 0.002 + 10_000_000 / 500e6)
    assert speed.latency == pytest.approx(0.002)
    assert speed.per_byte == pytest.approx(1 / 500e6)
    assert speed.seconds(1e9, 3) == pytest.approx(3 * 0.002 + 2.0)
    stats = speed.stats()
    assert stats.throughput_bytes_per_s == pytest.approx(500e6)
    assert stats.latency_s == pytest.approx(0.002)
    assert stats.samples == 2


def test_recent_reads_outweigh_old_ones() -> None:
    speed = TierSpeed()
    for _ in range(5):
        speed.observe(0, 0.001)
        speed.observe(8 << 20, 0.001 + (8 << 20) / 1e9)
    for _ in range(40):  # the tier slowed down ten times
        speed.observe(0, 0.001)
        speed.observe(8 << 20, 0.001 + (8 << 20) / 1e8)
    assert speed.per_byte == pytest.approx(1 / 1e8, rel=0.01)
    assert speed.latency == pytest.approx(0.001, rel=0.01)


def test_reads_of_one_size_put_what_is_not_latency_on_the_bytes() -> None:
    speed = TierSpeed()
    speed.observe(4 << 20, 0.05)
    assert speed.latency == 0.0
    assert speed.per_byte == pytest.approx(0.05 / (4 << 20))
    misses = TierSpeed()
    misses.observe(0, 0.003)
    assert misses.latency == pytest.approx(0.003)
    assert misses.per_byte is None
    assert misses.stats().throughput_bytes_per_s is None


def test_fast_tiers_load_everything() -> None:
    model = costs(disk=(5e9, 0.0002), redis=(2e9, 0.0005))
    runs = [run("cpu", 2), run("disk", 6), run("redis", 4)]
    decision = model.decide(
        runs, computed_tokens=0, total_tokens=12 * CHUNK + 100, prefill_tokens_per_s=5_000
    )
    assert decision.tokens == decision.hit_tokens == 12 * CHUNK
    assert decision.by_tier == {"cpu": 2 * CHUNK, "disk": 6 * CHUNK, "redis": 4 * CHUNK}
    assert decision.declined_by_tier == {}
    assert decision.load_seconds < decision.recompute_seconds
    assert decision.recompute_seconds == pytest.approx(12 * CHUNK / 5_000)


def test_nothing_loads_from_a_tier_slower_than_recomputing() -> None:
    # 20 MB/s against a prefill of 20k tokens/s: a token takes 6.5 ms to read, 50 us to
    # compute.
    model = costs(redis=(20 * MB, 0.001))
    runs = [run("cpu", 2), run("redis", 8)]
    decision = model.decide(
        runs, computed_tokens=0, total_tokens=10 * CHUNK, prefill_tokens_per_s=20_000
    )
    assert decision.tokens == 2 * CHUNK  # the CPU run is always worth it
    assert decision.load_seconds == 0.0
    assert decision.by_tier == {"cpu": 2 * CHUNK}
    assert decision.declined_by_tier == {"redis": 8 * CHUNK}
    only_redis = model.decide(
        [run("redis", 8)], computed_tokens=0, total_tokens=8 * CHUNK, prefill_tokens_per_s=20_000
    )
    assert only_redis.tokens == 0
    assert only_redis.by_tier == {}


def test_a_slow_tail_is_cut_where_the_fast_part_ends() -> None:
    model = costs(disk=(4e9, 0.0002), redis=(20 * MB, 0.001))
    runs = [run("cpu", 1), run("disk", 5), run("redis", 6)]
    decision = model.decide(
        runs, computed_tokens=0, total_tokens=12 * CHUNK, prefill_tokens_per_s=20_000
    )
    assert decision.tokens == 6 * CHUNK
    assert decision.by_tier == {"cpu": CHUNK, "disk": 5 * CHUNK}
    assert decision.declined_by_tier == {"redis": 6 * CHUNK}
    # Loading the disk run: 5 chunks of 32 MiB at 4 GB/s plus a call's latency.
    assert decision.load_seconds == pytest.approx(0.0002 + 5 * CHUNK * TOKEN_BYTES / 4e9)
    assert decision.recompute_seconds == pytest.approx(6 * CHUNK / 20_000)


def test_a_slow_tier_before_a_fast_one_is_weighed_with_what_follows() -> None:
    # A short slow stretch is worth reading to reach a long free one after it.
    model = costs(redis=(200 * MB, 0.001))
    runs = [run("redis", 1), run("cpu", 10)]
    decision = model.decide(
        runs, computed_tokens=0, total_tokens=11 * CHUNK, prefill_tokens_per_s=5_000
    )
    assert decision.tokens == 11 * CHUNK


def test_latency_dominates_small_runs() -> None:
    # 50 ms a call: one chunk (12.8 ms to recompute) is not worth a call; eight are.
    model = costs(redis=(10e9, 0.05))
    one = model.decide(
        [run("redis", 1)], computed_tokens=0, total_tokens=CHUNK, prefill_tokens_per_s=20_000
    )
    assert one.tokens == 0
    eight = model.decide(
        [run("redis", 8)], computed_tokens=0, total_tokens=8 * CHUNK, prefill_tokens_per_s=20_000
    )
    assert eight.tokens == 8 * CHUNK
    # Nine chunks take two calls of a prefetch's batches of eight: the ninth is not worth
    # its own call.
    nine = model.decide(
        [run("redis", 9)], computed_tokens=0, total_tokens=9 * CHUNK, prefill_tokens_per_s=20_000
    )
    assert nine.tokens == 8 * CHUNK
    assert nine.declined_by_tier == {"redis": CHUNK}


def test_an_unknown_prefill_speed_loads_everything_cached() -> None:
    model = costs(redis=(1 * MB, 0.5))
    decision = model.decide(
        [run("cpu", 1), run("redis", 4)], computed_tokens=0, total_tokens=6 * CHUNK
    )
    assert decision.tokens == decision.hit_tokens == 5 * CHUNK
    assert decision.prefill_tokens_per_s is None
    assert math.isnan(decision.recompute_seconds)
    assert decision.load_seconds == pytest.approx(0.5 + 4 * CHUNK * TOKEN_BYTES / MB)


def test_the_constructors_prefill_speed_is_used_unless_one_is_given() -> None:
    model = LoadCosts(["cpu", "redis"], chunk_size=CHUNK, prefill_tokens_per_s=20_000)
    model.observe("redis", 0, 0.001)
    model.observe("redis", 1 << 20, 0.001 + (1 << 20) / (20 * MB))
    runs = [run("redis", 4)]
    assert model.decide(runs, computed_tokens=0, total_tokens=4 * CHUNK).tokens == 0
    slow_prefill = model.decide(
        runs, computed_tokens=0, total_tokens=4 * CHUNK, prefill_tokens_per_s=10.0
    )
    assert slow_prefill.tokens == 4 * CHUNK
    assert slow_prefill.prefill_tokens_per_s == 10.0


def test_a_tier_not_measured_is_worth_loading() -> None:
    model = LoadCosts(["cpu", "disk", "redis"], chunk_size=CHUNK)
    decision = model.decide(
        [run("disk", 3), run("redis", 3)],
        computed_tokens=0,
        total_tokens=6 * CHUNK,
        prefill_tokens_per_s=1e9,
    )
    assert decision.tokens == 6 * CHUNK
    assert decision.load_seconds == 0.0


def test_what_the_serving_engine_computed_is_not_weighed() -> None:
    model = costs(redis=(20 * MB, 0.001))
    runs = [run("cpu", 2), run("redis", 4)]
    # Everything cached is computed already: nothing is worth reading.
    decision = model.decide(
        runs, computed_tokens=6 * CHUNK, total_tokens=8 * CHUNK, prefill_tokens_per_s=20_000
    )
    assert decision.tokens == 2 * CHUNK
    assert decision.load_seconds == 0.0
    assert decision.recompute_seconds == 0.0
    # A fast tier past what was computed: only the chunks from the computed one on are
    # read (the chunk holding token ``computed`` whole).
    fast = costs(disk=(1e9, 0.0))
    loaded = fast.decide(
        [run("disk", 6)],
        computed_tokens=3 * CHUNK + 10,
        total_tokens=6 * CHUNK,
        prefill_tokens_per_s=1_000,
    )
    assert loaded.tokens == 6 * CHUNK
    assert loaded.load_seconds == pytest.approx(3 * CHUNK * TOKEN_BYTES / 1e9)
    assert loaded.recompute_seconds == pytest.approx((3 * CHUNK - 10) / 1_000)


def test_a_short_last_chunk_is_a_boundary() -> None:
    model = LoadCosts(["cpu", "disk"], chunk_size=CHUNK)
    runs = [Run("disk", 2 * CHUNK + 17, (2 * CHUNK + 17) * TOKEN_BYTES)]
    decision = model.decide(
        runs, computed_tokens=0, total_tokens=2 * CHUNK + 17, prefill_tokens_per_s=1.0
    )
    assert decision.tokens == 2 * CHUNK + 17


def test_no_runs_promise_nothing() -> None:
    decision = LoadCosts(["cpu"], chunk_size=CHUNK).decide(
        [], computed_tokens=0, total_tokens=100, prefill_tokens_per_s=1.0
    )
    assert decision == LoadDecision(0, 0, 0.0, 0.0, 1.0, {}, {})


def test_records_count_promised_and_declined_tokens_by_tier() -> None:
    model = costs(disk=(4e9, 0.0002), redis=(20 * MB, 0.001))
    runs = [run("cpu", 1), run("disk", 5), run("redis", 6)]
    for _ in range(2):
        model.record(
            model.decide(
                runs, computed_tokens=0, total_tokens=12 * CHUNK, prefill_tokens_per_s=20_000
            )
        )
    model.record(model.decide([run("disk", 2)], computed_tokens=0, total_tokens=2 * CHUNK))
    stats = model.stats()
    assert stats.decisions == 3
    assert stats.cut_decisions == 2
    assert stats.prefill_tokens_per_s is None  # the last decision's
    assert dict(stats.promised_tokens) == {"cpu": 2 * CHUNK, "disk": 12 * CHUNK}
    assert dict(stats.declined_tokens) == {"redis": 12 * CHUNK}
    assert stats.tiers["redis"].samples == 2
    assert stats.tiers["redis"].throughput_bytes_per_s == pytest.approx(20 * MB)
    assert "cpu" not in stats.tiers


def test_bad_samples_are_ignored_and_bad_arguments_refused() -> None:
    model = LoadCosts(["cpu", "disk"], chunk_size=CHUNK)
    for nbytes, seconds in ((-1, 0.1), (10, math.inf), (10, -0.5), (1.5, 0.1)):
        model.observe("disk", nbytes, seconds)  # type: ignore[arg-type]
    model.observe("nvme", 10, 0.1)
    assert model.stats().tiers["disk"].samples == 0
    with pytest.raises(InvalidInputError, match="prefill_tokens_per_s"):
        model.decide([], computed_tokens=0, total_tokens=0, prefill_tokens_per_s=0.0)
    with pytest.raises(InvalidInputError, match="computed_tokens"):
        model.decide([], computed_tokens=-1, total_tokens=0)
    with pytest.raises(InvalidInputError, match="chunk_size"):
        LoadCosts(["cpu"], chunk_size=0)
    with pytest.raises(InvalidInputError, match="prefill_tokens_per_s"):
        LoadCosts(["cpu"], chunk_size=CHUNK, prefill_tokens_per_s=math.nan)
