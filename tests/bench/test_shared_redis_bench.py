"""``bench --shared-redis``: its settings are checked before anything starts; the sidecar's
metrics become per-phase counts; the report sets every phase beside A's warm hit, compares
A's and B's tokens and names what went wrong. (A real run, two vLLM servers and two
sidecars, takes over two minutes even at the smallest settings: it is the benchmark's.)"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from lmcache_async.bench.shared_redis import PHASES, SharedRedisOptions, format_shared_redis
from lmcache_async.bench.shared_redis.bench import make_prompts, make_warmups
from lmcache_async.bench.shared_redis.report import Answer, counter_deltas, summarise
from lmcache_async.bench.shared_redis.sidecar import SidecarProcess, _ping, parse_metrics
from lmcache_async.cli import main
from lmcache_async.errors import InvalidInputError
from tests.servers import RedisServer

pytestmark = pytest.mark.usefixtures("restore_logging")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"prefixes": 0}, "prefixes must be an int >= 1"),
        ({"prefix_tokens": 1000}, "multiple of chunk_size"),
        ({"chunk_size": 48}, "multiple of block_size"),
        ({"suffix_tokens": 64}, "below chunk_size"),
        ({"max_tokens": True}, "max_tokens must be an int"),
        ({"seed": 1.5}, "seed must be an int"),
        ({"warmup_prompts": -1}, "warmup_prompts must be an int >= 0"),
        ({"warmup_prompts": True}, "warmup_prompts must be an int >= 0"),
    ],
)
def test_bad_settings_are_refused(changes: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        SharedRedisOptions(**changes).validate()  # type: ignore[arg-type]


def test_cli_refuses_bad_settings_before_starting_anything(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench", "--shared-redis", "--shared-prefix-tokens", "1000"]) == 2
    assert "multiple of chunk_size" in capsys.readouterr().err


def test_the_sizes_fit_one_request_and_every_prompt() -> None:
    """vLLM holds one prompt and its generated tokens in whole blocks; each RAM tier holds
    every prompt (the warm-up one too) without evicting."""
    options = SharedRedisOptions(prefixes=8, prefix_tokens=1024, suffix_tokens=8, max_tokens=8)
    assert options.max_model_len == 1056
    assert options.vllm_blocks * options.block_size > options.max_model_len
    assert options.chunks == 9 * 16
    assert options.redis_chunks == (9 + 2 * options.warmup_prompts) * 16  # both hosts' warm-ups
    kv = 4096
    prompts = 9 + options.warmup_prompts  # a host's own warm-ups stay in its RAM too
    assert options.cpu_tier_gb(kv) * 1024**3 >= prompts * options.prompt_tokens * kv


def test_each_host_warms_up_on_prompts_no_other_prompt_shares_a_chunk_with() -> None:
    options = SharedRedisOptions(prefixes=3, prefix_tokens=128, warmup_prompts=2)
    measured = make_prompts(options, 1000)
    warmups = {host: make_warmups(options, 1000, host) for host in ("a", "b")}
    assert [len(p) for p in warmups["a"] + warmups["b"]] == [options.prompt_tokens] * 4
    assert make_warmups(options, 1000, "a") == warmups["a"]  # seeded
    firsts = [tuple(p[: options.chunk_size]) for p in measured + warmups["a"] + warmups["b"]]
    assert len(set(firsts)) == len(firsts)  # every first chunk differs: no shared prefix


def test_metrics_become_counts_and_mean_latencies_by_operation() -> None:
    text_before = (
        "# HELP x\n"
        "lmcache_async_promises_total 2.0\n"
        'lmcache_async_request_latency_seconds_count{op="promise"} 4.0\n'
        'lmcache_async_request_latency_seconds_sum{op="promise"} 0.4\n'
    )
    text_after = (
        "lmcache_async_promises_total 5.0\n"
        "lmcache_async_promoted_chunks_total 16.0\n"
        'lmcache_async_request_latency_seconds_count{op="promise"} 6.0\n'
        'lmcache_async_request_latency_seconds_sum{op="promise"} 0.5\n'
        'lmcache_async_request_latency_seconds_count{op="store"} 0.0\n'
    )
    deltas = counter_deltas(parse_metrics(text_before), parse_metrics(text_after))
    assert deltas["promises"] == 3
    assert deltas["promoted_chunks"] == 16
    assert deltas["promise_calls"] == 2
    assert deltas["promise_mean_ms"] == pytest.approx(50.0)
    assert "store_calls" not in deltas


def _answers(ms: float, cached: int, tokens: tuple[int, ...] = (7, 8)) -> list[Answer]:
    return [Answer(n, ms / 1000 * n, 1032, cached, tokens) for n in (1, 2)]


def test_the_report_sets_every_phase_beside_a_warm() -> None:
    options = SharedRedisOptions()
    answers = {
        "a-cold": _answers(200, 0),
        "a-warm": _answers(40, 1024),
        "b-redis": _answers(50, 1024),
        "b-warm": _answers(40, 1024),
    }
    results = summarise(
        options,
        answers,
        {"b-redis": {"promises": 2.0}},
        redis_wait_s=0.1,
        redis_keys=144,
        idle_wait_s={"a-cold": 0.25, "b-redis": 1.2},
    )
    assert list(results["phases"]) == list(PHASES)
    assert results["phases"]["a-warm"]["ttft_ms"]["mean"] == pytest.approx(60.0)
    assert results["over_a_warm"]["b-redis"] == pytest.approx(1.25)
    assert results["over_a_warm"]["a-cold"] == pytest.approx(5.0)
    assert results["same_tokens_a_warm_b"] is True
    assert results["problems"] == []
    text = format_shared_redis(results)
    assert "B from Redis / A warm: 1.25x (goal <= 1.5x: met)" in text
    assert "sidecar b-redis: promises 2" in text
    assert "both hosts were idle, after: a-cold 0.2 s, b-redis 1.2 s" in text
    assert "warmed up first on 4 prompts of its own, twice" in text


def test_the_report_names_misses_and_different_tokens() -> None:
    answers = {
        "a-cold": _answers(200, 64),
        "a-warm": _answers(40, 1024),
        "b-redis": _answers(200, 512, tokens=(7, 9)),
    }
    results = summarise(SharedRedisOptions(), answers, {}, redis_wait_s=60, redis_keys=3)
    problems = "\n".join(results["problems"])
    assert "b-redis: 1024 of 2048 prefix tokens hit" in problems
    assert "a-cold: 128 tokens hit" in problems
    assert "different tokens" in problems
    assert "missed" in format_shared_redis(results)


def test_without_token_ids_nothing_is_compared() -> None:
    answers = {"a-warm": _answers(40, 1024, ()), "b-redis": _answers(50, 1024, ())}
    results = summarise(SharedRedisOptions(), answers, {}, redis_wait_s=0, redis_keys=0)
    assert results["same_tokens_a_warm_b"] is None
    assert math.isnan(results["over_a_warm"].get("a-cold", math.nan))


@pytest.mark.subprocess
def test_a_sidecar_started_for_the_bench_answers_its_ping(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """The readiness check of a real ``lmcache-async serve`` (a fresh socket per try)
    passes once it listens, and fails for a socket nobody serves."""
    sidecar = SidecarProcess(
        tmp_path, "sidecar", redis_url=redis_server.url, cpu_gb=0.01, chunk_size=64
    )
    sidecar.start()
    try:
        assert _ping(sidecar.url)
        assert not _ping(f"ipc://{tmp_path / 'nobody.sock'}")
    finally:
        sidecar.stop()
