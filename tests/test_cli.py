"""The ``lmcache-async`` command line: ``check-config``, an in-process ``bench`` run, and
the usage rules of ``ctl erase`` and ``stats --by-tenant``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import yaml

from lmcache_async.cli import main
from lmcache_async.config import EngineConfig

TINY_SHAPE = ["--layers", "2", "--kv-heads", "2", "--head-size", "16", "--chunk-size", "32"]


# ``main`` configures logging onto the captured stderr: undone after each test.
pytestmark = pytest.mark.usefixtures("restore_logging")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``LMCACHE_ASYNC_*`` variable of the outer environment leaks into a test."""
    import os

    for name in list(os.environ):
        if name.startswith("LMCACHE_ASYNC_"):
            monkeypatch.delenv(name)


def test_check_config_prints_effective_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "good.yaml"
    path.write_text("chunk_size: 128\nmax_local_cpu_size: 1.5\n")
    monkeypatch.setenv("LMCACHE_ASYNC_PIN_TIMEOUT", "7")

    assert main(["check-config", str(path)]) == 0

    out = yaml.safe_load(capsys.readouterr().out)
    expected = EngineConfig(chunk_size=128, max_local_cpu_size=1.5, pin_timeout=7.0).to_dict()
    assert out == expected


def test_check_config_without_file_prints_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out) == EngineConfig().to_dict()


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("chunk_size: -1\n", "chunk_size"),
        ("max_local_cpu_size: lots\n", "max_local_cpu_size"),
        ("chunk_sise: 256\n", "chunk_sise"),
        ("- not\n- a mapping\n", "config_file"),
    ],
)
def test_check_config_bad_file_names_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, field: str
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)

    assert main(["check-config", str(path)]) == 2

    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"error: {field}: ")


def test_check_config_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-config", str(tmp_path / "absent.yaml")]) == 2
    assert capsys.readouterr().err.startswith("error: config_file: ")


def test_check_config_bad_environment(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LMCACHE_ASYNC_CHUNK_SIZE", "many")
    assert main(["check-config"]) == 2
    assert capsys.readouterr().err.startswith("error: chunk_size: ")


def test_no_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "check-config" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["ctl", "erase"], "ctl erase needs --tenant NAME (or --own-tenant"),
        (["ctl", "erase", "on", "--tenant", "a"], "ctl erase takes no state"),
        (["ctl", "clear", "--tenant", "a"], "ctl clear takes no tenant"),
        (["ctl", "freeze", "on", "--own-tenant"], "ctl freeze takes no tenant"),
        (["ctl", "erase", "--tenant", "a", "--own-tenant"], "not allowed with argument"),
        (["ctl", "erase", "--tenant", "x" * 300], "tenant must be at most 256 UTF-8 bytes"),
    ],
)
def test_ctl_erase_names_exactly_one_tenant(
    argv: list[str], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"ipc://{tmp_path}/nobody.sock"
    assert main([*argv, "--url", url, "--timeout", "0.2"]) == 2
    assert needle in capsys.readouterr().err


def test_erase_and_stats_by_tenant_exit_1_without_a_sidecar(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"ipc://{tmp_path}/nobody.sock"
    assert main(["ctl", "erase", "--tenant", "a", "--url", url, "--timeout", "0.2"]) == 1
    assert "did not answer ERASE within 0.2 s" in capsys.readouterr().err
    assert main(["stats", "--by-tenant", "--url", url, "--timeout", "0.2"]) == 1
    assert "did not answer STATS within 0.2 s" in capsys.readouterr().err


def test_bad_flag_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--dtype", "int8"]) == 2
    assert "--dtype" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--users", "0"], "users must be > 0"),
        (["--system-prompt-tokens", "9000"], "max_context_tokens"),
        (["--chunk-size", "0"], "error: chunk_size: "),
    ],
)
def test_bench_bad_options_are_usage_errors(
    capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    assert main(["bench", "--quiet", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ")
    assert needle in err


def test_bench_in_process_json_is_consistent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_path = tmp_path / "bench.json"
    argv = [
        "bench",
        *TINY_SHAPE,
        "--duration",
        "1",
        "--users",
        "3",
        "--concurrency",
        "2",
        "--system-prompt-tokens",
        "64",
        "--turn-tokens",
        "48",
        "--max-context-tokens",
        "512",
        "--cache-gb",
        "0.05",
        "--verify-every",
        "1",
        "--json",
        str(out_path),
        "--quiet",
    ]

    assert main(argv) == 0

    assert capsys.readouterr().out == ""  # --quiet
    data: dict[str, Any] = json.loads(out_path.read_text())
    token_bytes = 2 * 2 * 2 * 16 * 2  # K/V x layers x heads x head size x bf16
    assert data["token_bytes"] == token_bytes
    assert data["errors"] == {}
    assert data["errors_total"] == 0
    assert data["verify_failures"] == 0
    assert data["verified_retrieves"] > 0
    # Every turn is one lookup and one store; a retrieve only when something was cached.
    assert data["requests"] > data["options"]["users"]
    assert data["lookups"] == data["requests"] == data["stores"]
    assert 0 < data["retrieves"] <= data["lookups"]
    assert 0 < data["lookup_hit_tokens"] <= data["prompt_tokens"]
    assert math.isclose(data["hit_rate"], data["lookup_hit_tokens"] / data["prompt_tokens"])
    # Lookups pinned their hits, so each retrieve loaded exactly what its lookup found.
    assert data["retrieve_short"] == 0
    assert data["tokens_loaded"] == data["lookup_hit_tokens"]
    assert data["bytes_stored"] == data["tokens_stored"] * token_bytes
    assert data["bytes_loaded"] == data["tokens_loaded"] * token_bytes
    assert 0 < data["tokens_stored"] <= data["store_requested_tokens"]
    assert data["partial_stores"] == 0
    for op in ("lookup", "retrieve", "compute", "store"):
        stat = data["latency_ms"][op]
        assert stat["count"] > 0
        assert 0 < stat["p50"] <= stat["p90"] <= stat["p99"]
    assert data["latency_ms"]["lookup"]["count"] == data["lookups"]
    engine = data["engine_stats"]
    assert engine["lookup_hit_tokens"] == data["lookup_hit_tokens"]
    assert engine["stored_tokens"] == data["tokens_stored"]
    assert engine["retrieved_tokens"] == data["tokens_loaded"]
    assert engine["failed_requests"] == engine["timed_out_requests"] == 0
    assert data["pool_used_bytes_after_clear"] == 0
    assert data["engine_config"]["chunk_size"] == 32


def test_bench_summary_names_every_figure(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "bench",
        *TINY_SHAPE,
        "--duration",
        "0.5",
        "--users",
        "2",
        "--system-prompt-tokens",
        "64",
        "--turn-tokens",
        "32",
        "--cache-gb",
        "0.05",
    ]
    assert main(argv) == 0
    captured = capsys.readouterr()
    for needle in ("hit rate", "GB/s", "p50 ms", "p99 ms", "lookup", "retrieve", "store"):
        assert needle in captured.out
    assert "errors: 0" in captured.out
    assert "retrieves bit-exact" in captured.out
