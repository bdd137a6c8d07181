"""The benchmarks: helpers, the micro-benchmarks' figures, and the real console script."""

from __future__ import annotations

import io
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmcache_async import KVLayout
from lmcache_async.bench import Progress, format_table, parse_dtype, percentiles, write_json
from lmcache_async.bench.workloads import KVSource, Segment, same_bytes, token_dim
from lmcache_async.errors import InvalidInputError

TINY_SHAPE = ["--layers", "2", "--kv-heads", "2", "--head-size", "16", "--chunk-size", "64"]


# ``main`` configures logging onto the captured stderr: undone after each test.
pytestmark = pytest.mark.usefixtures("restore_logging")


def test_percentiles_interpolate_between_ranks() -> None:
    stat = percentiles([5.0, 1.0, 4.0, 2.0, 3.0], (0, 50, 90, 100))
    assert stat == {"count": 5.0, "mean": 3.0, "p0": 1.0, "p50": 3.0, "p90": 4.6, "p100": 5.0}


def test_percentiles_of_nothing_are_nan() -> None:
    stat = percentiles([])
    assert stat["count"] == 0
    assert all(math.isnan(stat[k]) for k in ("mean", "p50", "p90", "p99"))


def test_format_table_aligns_columns() -> None:
    text = format_table(["name", "value"], [["a", "1"], ["longer", "22"]])
    assert text.splitlines() == [
        "name    value",
        "------  -----",
        "a           1",
        "longer     22",
    ]


def test_parse_dtype() -> None:
    assert parse_dtype("float16") is torch.float16
    with pytest.raises(InvalidInputError, match="int8"):
        parse_dtype("int8")


def test_write_json_replaces_non_finite(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    write_json(path, {"a": math.nan, "b": [1.5, math.inf], "c": {"d": 2}})
    assert json.loads(path.read_text()) == {"a": None, "b": [1.5, None], "c": {"d": 2}}


def test_same_bytes_is_bit_exact() -> None:
    a = torch.tensor([0.0, 1.0], dtype=torch.bfloat16)
    assert same_bytes(a, a.clone())
    assert not same_bytes(a, torch.tensor([-0.0, 1.0], dtype=torch.bfloat16))
    assert not same_bytes(a, a.to(torch.float16))


def test_token_dim_of_payloads() -> None:
    flash = KVLayout.vllm_flash_attn(
        num_layers=2, block_size=16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16
    )
    mla = KVLayout.mla(num_layers=3, block_size=16, latent_dim=32, dtype=torch.bfloat16)
    assert token_dim(flash) == 2
    assert token_dim(mla) == 2


def _console_script() -> str:
    script = Path(sys.executable).with_name("lmcache-async")
    if script.exists():
        return str(script)
    found = shutil.which("lmcache-async")
    if found is None:
        pytest.skip("the lmcache-async console script is not installed")
    return found


@pytest.mark.subprocess
@pytest.mark.slow
def test_console_script_bench_prints_summary(tmp_path: Path) -> None:
    out_path = tmp_path / "run.json"
    argv = [
        _console_script(),
        "bench",
        *TINY_SHAPE,
        "--duration",
        "1",
        "--users",
        "2",
        "--system-prompt-tokens",
        "128",
        "--turn-tokens",
        "64",
        "--cache-gb",
        "0.05",
        "--json",
        str(out_path),
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=240, check=False)

    assert proc.returncode == 0, proc.stderr
    assert "hit rate:" in proc.stdout
    assert "GB/s" in proc.stdout
    assert "errors: 0" in proc.stdout
    assert "retrieves bit-exact" in proc.stdout
    data = json.loads(out_path.read_text())
    assert data["errors_total"] == 0
    assert f"{data['requests']} requests" in proc.stdout


def test_progress_without_tqdm_prints_a_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # makes `import tqdm` raise ImportError
    stream = io.StringIO()
    progress = Progress(8.0, stream)
    progress.update(1.25, "requests=3")
    progress.close()
    assert stream.getvalue() == "bench   1.2/8 s  requests=3\n"


def test_progress_with_tqdm_shows_the_text() -> None:
    pytest.importorskip("tqdm")
    stream = io.StringIO()
    progress = Progress(8.0, stream)
    progress.update(2.0, "requests=5 hit=50.0%")
    progress.close()
    assert "requests=5 hit=50.0%" in stream.getvalue()


def test_kv_source_gives_a_token_the_same_bits_at_any_position_set() -> None:
    layout = KVLayout.vllm_flash_attn(
        num_layers=2, block_size=16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16
    )
    source = KVSource(layout, seed=3)
    segments = [Segment(0, 0, 100), Segment(7, 100, 40), Segment(8, 140, 2100)]
    full = source.payload(segments, torch.arange(2240))
    assert full.shape == layout.payload_shape(2240)
    picked = torch.tensor([0, 99, 100, 139, 140, 179, 5, 2239])
    assert same_bytes(source.payload(segments, picked), full.index_select(2, picked))
    # Different segments at the same offset carry different KV; the same segment the same.
    assert not torch.equal(full[:, :, 100], full[:, :, 140])
    # A long segment does not repeat itself after the base's 1024 rows.
    assert not torch.equal(full[:, :, 140], full[:, :, 140 + 1024])
    again = KVSource(layout, seed=3).payload(segments, torch.arange(2240))
    assert same_bytes(again, full)
