"""The load generator: workloads, runs against an embedded engine and a sidecar, the
consistency of the summary figures, the JSON and the PNG."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import struct
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from lmcache_async import EngineConfig, RemoteCacheEngine, TierUnavailableError
from lmcache_async.bench import write_json
from lmcache_async.bench.loadgen import (
    OPERATIONS,
    LoadOptions,
    format_summary,
    run_load_async,
    write_plot,
)
from lmcache_async.bench.workloads import LongDocQA, MultiRoundChat, RandomPrompts
from lmcache_async.cli import main
from lmcache_async.errors import InvalidInputError

CHUNK = 32
TINY: dict[str, Any] = {
    "num_layers": 2,
    "num_kv_heads": 2,
    "head_size": 16,
    "dtype": "float16",
    "block_size": 8,
    "progress": False,
}
WORKLOAD_SIZES: dict[str, dict[str, Any]] = {
    "multi-round-chat": {"users": 3, "system_prompt_tokens": 96, "turn_tokens": 40},
    "long-doc-qa": {"documents": 3, "questions": 2, "document_tokens": 150, "question_tokens": 20},
    "random": {"min_prompt_tokens": 20, "max_prompt_tokens": 150},
}
CONFIG = EngineConfig(chunk_size=CHUNK, max_local_cpu_size=0.05)
READY_TIMEOUT = 90.0  # a loaded CI machine takes a while to import torch
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def options(workload: str, **overrides: Any) -> LoadOptions:
    settings: dict[str, Any] = {
        **TINY,
        **WORKLOAD_SIZES[workload],
        "workload": workload,
        "duration": 0.8,
        "concurrency": 2,
    }
    settings.update(overrides)
    return LoadOptions(**settings)


# ``main`` configures logging onto the captured stderr: undone after each test.
pytestmark = pytest.mark.usefixtures("restore_logging")


def check_consistent(results: dict[str, Any], *, embedded: bool = True) -> None:
    """The summary's figures agree with each other and with the engine's own counters."""
    opts = results["options"]
    itemsize = torch.empty(0, dtype=getattr(torch, opts["dtype"])).element_size()
    token_bytes = 2 * opts["num_layers"] * opts["num_kv_heads"] * opts["head_size"] * itemsize
    assert results["token_bytes"] == token_bytes
    assert results["requests"] > 0
    assert results["errors_total"] == 0, results["errors"]
    assert results["verify_failures"] == 0
    assert results["lookups"] == results["requests"]
    assert results["retrieves"] <= results["lookups"]
    assert results["stores"] == results["requests"]
    assert 0 <= results["lookup_hit_tokens"] <= results["prompt_tokens"]
    assert results["tokens_loaded"] <= results["lookup_hit_tokens"]
    hit_rate = results["lookup_hit_tokens"] / results["prompt_tokens"]
    assert math.isclose(results["hit_rate"], hit_rate)
    for kind in ("loaded", "stored"):
        assert results[f"bytes_{kind}"] == results[f"tokens_{kind}"] * token_bytes
        assert math.isclose(results[f"gb_{kind}"], results[f"bytes_{kind}"] / 1e9)
        per_second = results[f"tokens_{kind}"] / results["wall_seconds"]
        assert math.isclose(results[f"tokens_per_second_{kind}"], per_second)
    assert results["tokens_stored"] <= results["store_requested_tokens"]

    samples = results["samples"]
    assert all(len(column) == results["requests"] for column in samples.values())
    assert sum(samples["prompt_tokens"]) == results["prompt_tokens"]
    assert sum(samples["hit_tokens"]) == results["lookup_hit_tokens"]
    assert sum(samples["loaded_tokens"]) == results["tokens_loaded"]
    for op in OPERATIONS:
        stat = results["latency_ms"][op]
        timed = [v for v in samples[f"{op}_ms"] if v is not None and not math.isnan(v)]
        assert stat["count"] == len(timed)
        if timed:
            assert min(timed) <= stat["p50"] <= stat["p90"] <= stat["p99"] <= max(timed)
    assert results["latency_ms"]["retrieve"]["count"] == results["retrieves"]

    stats = results["engine_stats"]
    if embedded:
        # The engine counts for itself what the run counted per request.
        assert stats["retrieved_tokens"] == results["tokens_loaded"]
        assert stats["stored_tokens"] == results["tokens_stored"]
        assert stats["lookup_hit_tokens"] == results["lookup_hit_tokens"]
        assert stats["lookup_tokens"] == results["prompt_tokens"]
        assert results["pool_used_bytes_after_clear"] == 0
        assert results["cleared_chunks"] == stats["cached_chunks"]


# -- workloads --------------------------------------------------------------------------------


def test_chat_grows_each_users_history_and_starts_over_when_full() -> None:
    chat = MultiRoundChat(
        seed=1, users=2, system_prompt_tokens=10, turn_tokens=4, max_context_tokens=20, vocab_size=9
    )
    first = chat.next_prompt(0)
    second = chat.next_prompt(0)
    other = chat.next_prompt(1)
    assert first.num_tokens == 14 and second.num_tokens == 18
    assert torch.equal(second.tokens[:14], first.tokens)
    assert torch.equal(other.tokens[:10], first.tokens[:10])  # the shared system prompt
    assert not torch.equal(other.tokens[10:], first.tokens[10:])
    assert [seg.start for seg in second.segments] == [0, 10, 14]
    assert second.name == "u0-c0-t2"
    restarted = chat.next_prompt(0)  # 18 + 4 > 20: a new conversation
    assert restarted.num_tokens == 14
    assert restarted.name == "u0-c1-t1"
    assert torch.equal(restarted.tokens[:10], first.tokens[:10])
    assert chat.conversations == 3
    with pytest.raises(InvalidInputError, match="session"):
        chat.next_prompt(2)


def test_doc_qa_asks_every_pair_once_per_round() -> None:
    qa = LongDocQA(
        seed=0, documents=3, questions=2, document_tokens=30, question_tokens=5, vocab_size=100
    )
    round_one = [qa.next_prompt(0) for _ in range(6)]
    names = [p.name.rsplit("-", 1)[0] for p in round_one]
    assert sorted(names) == [f"d{d}-q{q}" for d in range(3) for q in range(2)]
    assert names != sorted(names)  # a shuffled order (fixed by the seed)
    by_name = dict(zip(names, round_one, strict=True))
    assert torch.equal(by_name["d1-q0"].tokens[:30], by_name["d1-q1"].tokens[:30])
    assert not torch.equal(by_name["d0-q0"].tokens[:30], by_name["d1-q0"].tokens[:30])
    assert all(p.num_tokens == 35 for p in round_one)
    assert qa.next_prompt(0).name.endswith("-r2")


def test_random_prompts_stay_in_bounds_and_replay_with_the_seed() -> None:
    def draw(seed: int) -> list[torch.Tensor]:
        prompts = RandomPrompts(seed=seed, min_tokens=5, max_tokens=9, vocab_size=1000)
        return [prompts.next_prompt(0).tokens for _ in range(20)]

    lengths = {int(t.numel()) for t in draw(4)}
    assert lengths <= set(range(5, 10)) and len(lengths) > 1
    assert all(torch.equal(a, b) for a, b in zip(draw(4), draw(4), strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(draw(4), draw(5), strict=True))


def test_workloads_draw_different_tokens_for_the_same_seed() -> None:
    chat = MultiRoundChat(
        seed=0,
        users=1,
        system_prompt_tokens=64,
        turn_tokens=8,
        max_context_tokens=99,
        vocab_size=1000,
    )
    qa = LongDocQA(
        seed=0, documents=1, questions=1, document_tokens=64, question_tokens=8, vocab_size=1000
    )
    assert not torch.equal(chat.next_prompt(0).tokens[:64], qa.next_prompt(0).tokens[:64])


def test_options_refuse_bad_input() -> None:
    with pytest.raises(InvalidInputError, match="target vllm needs"):  # vLLM, or a model
        options("random", target="vllm").validate()
    with pytest.raises(InvalidInputError, match="--url"):
        options("random", target="sidecar").validate()
    with pytest.raises(InvalidInputError, match="workload must be one of"):
        dataclasses.replace(options("random"), workload="chat").validate()
    with pytest.raises(InvalidInputError, match="rate"):
        options("random", rate=-1.0).validate()
    with pytest.raises(InvalidInputError, match="min_prompt_tokens must be <="):
        options("random", min_prompt_tokens=200).make_workload()
    with pytest.raises(InvalidInputError, match="max_context_tokens"):
        options("multi-round-chat", max_context_tokens=100).make_workload()


# -- runs against an embedded engine ----------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("workload", list(WORKLOAD_SIZES))
async def test_each_workload_runs_embedded_and_adds_up(workload: str) -> None:
    with anyio.fail_after(60):
        results = await run_load_async(options(workload), CONFIG)
    check_consistent(results)
    assert results["workload"] == workload
    assert results["chunk_size"] == CHUNK
    if workload == "random":
        assert results["lookup_hit_tokens"] == 0
        assert results["tokens_loaded"] == 0
    else:
        assert results["hit_rate"] > 0.3
        assert results["verified_retrieves"] == results["retrieves"] > 0


@pytest.mark.anyio
async def test_fixed_rate_starts_one_request_per_period() -> None:
    run = options("long-doc-qa", rate=20.0, arrival="fixed", duration=1.0, concurrency=3)
    with anyio.fail_after(60):
        results = await run_load_async(run, CONFIG)
    check_consistent(results)
    # Arrivals at 0.05, 0.10, ... < 1.0 s, however fast the requests are served.
    assert 19 <= results["requests"] <= 20
    assert results["in_flight"] == 3
    starts = sorted(results["samples"]["t"])
    assert starts[0] >= 0.04
    latency = results["latency_ms"]
    assert latency["request"]["p50"] >= latency["store"]["p50"]


@pytest.mark.anyio
async def test_json_round_trips_and_the_plot_is_a_png(tmp_path: Path) -> None:
    with anyio.fail_after(60):
        results = await run_load_async(options("random", rate=50.0), CONFIG)
    path = tmp_path / "run.json"
    write_json(path, results)
    loaded = json.loads(path.read_text())
    # The random workload never retrieves: its NaN latencies come back as null.
    assert loaded["latency_ms"]["retrieve"]["p50"] is None
    assert loaded["requests"] == results["requests"]
    assert loaded["samples"]["prompt_tokens"] == results["samples"]["prompt_tokens"]
    assert format_summary(loaded) == format_summary(results)

    png = tmp_path / "run.png"
    write_plot(loaded, png)
    data = png.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (900, 650)


def test_cli_runs_a_workload_and_writes_json_and_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    json_path, png_path = tmp_path / "r.json", tmp_path / "r.png"
    argv = [
        "bench",
        "--workload",
        "long-doc-qa",
        *("--layers", "2", "--kv-heads", "2", "--head-size", "16", "--chunk-size", str(CHUNK)),
        *("--documents", "2", "--questions", "2", "--document-tokens", "100"),
        *("--question-tokens", "10", "--duration", "0.6", "--cache-gb", "0.05"),
        *("--json", str(json_path), "--plot", str(png_path)),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    data = json.loads(json_path.read_text())
    assert out.startswith("lmcache-async bench: long-doc-qa against embedded")
    assert f"{data['requests']} requests" in out
    assert "hit rate:" in out and "errors: 0" in out
    assert png_path.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--target", "vllm"], "target vllm needs"),
        (["--target", "sidecar"], "--url"),
        (["--workload", "random", "--min-prompt-tokens", "9", "--max-prompt-tokens", "3"], "<="),
    ],
)
def test_cli_usage_errors(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", *extra]) == 2
    assert message in capsys.readouterr().err


def test_cli_plot_without_matplotlib_fails_before_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    json_path = tmp_path / "r.json"
    assert main(["bench", "--plot", str(tmp_path / "r.png"), "--json", str(json_path)]) == 2
    assert "lmcache-async[bench]" in capsys.readouterr().err
    assert not json_path.exists()


# -- runs against a sidecar -------------------------------------------------------------------


def serve_command() -> list[str]:
    script = Path(sys.executable).with_name("lmcache-async")
    return [str(script)] if script.exists() else [sys.executable, "-m", "lmcache_async.cli"]


async def wait_ready(url: str, process: subprocess.Popen[bytes]) -> bool:
    """Say hello until the sidecar answers (bounded; the hello fixes the bench namespace);
    False when the sidecar exited instead."""
    layout = options("random").layout()
    with anyio.fail_after(READY_TIMEOUT):
        while True:
            if process.poll() is not None:
                return False
            try:
                async with RemoteCacheEngine.connect(
                    url, layout, model_name=LoadOptions().model_name, timeout=0.5
                ):
                    return True
            except TierUnavailableError:
                continue


@pytest.fixture
def sidecar_url(tmp_path: Path) -> Iterator[str]:
    """A fresh ``lmcache-async serve`` on an ipc socket, answering before the test starts."""
    short = Path(tempfile.mkdtemp(prefix="lmc-lg-", dir="/tmp"))  # ipc paths are short
    url = f"ipc://{short}/bench.sock"
    log_path = tmp_path / "sidecar.log"
    args = [*serve_command(), "serve", "--listen", url, "--chunk-size", str(CHUNK)]
    args += ["--max-local-cpu-size", "0.05"]
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        if not anyio.run(wait_ready, url, process):
            raise RuntimeError(f"the sidecar exited:\n{log_path.read_text()}")
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)
        shutil.rmtree(short, ignore_errors=True)


@pytest.mark.anyio
@pytest.mark.subprocess
@pytest.mark.slow
async def test_workloads_run_against_a_sidecar_that_keeps_the_cache(sidecar_url: str) -> None:
    with anyio.fail_after(120):
        chat = await run_load_async(
            options("multi-round-chat", target="sidecar", url=sidecar_url), CONFIG
        )
        check_consistent(chat, embedded=False)
        assert chat["chunk_size"] == CHUNK
        assert chat["hit_rate"] > 0.3
        assert chat["verified_retrieves"] == chat["retrieves"] > 0
        assert chat["engine_stats"]["client"]["shared_memory"] is True
        # The server counted the traffic too.
        assert chat["engine_stats"]["retrieved_tokens"] == chat["tokens_loaded"]

        qa = await run_load_async(
            options("long-doc-qa", target="sidecar", url=sidecar_url, rate=30.0), CONFIG
        )
        check_consistent(qa, embedded=False)
        # The same chat again: its first request finds what the first run left behind,
        # and every retrieve of the old cache is still bit-exact.
        again = await run_load_async(
            options("multi-round-chat", target="sidecar", url=sidecar_url, duration=0.3),
            CONFIG,
        )
    check_consistent(again, embedded=False)
    first = min(range(again["requests"]), key=again["samples"]["t"].__getitem__)
    assert again["samples"]["hit_tokens"][first] >= 96 // CHUNK * CHUNK
    assert again["verified_retrieves"] == again["retrieves"]
