"""Reading a trace: every rule of the format is an error naming its line, through the
function and through ``bench --trace`` (a usage error, exit 2); an empty trace serves
nothing and divides by nothing."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path
from typing import Any

import pytest

from lmcache_async.bench.trace import read_trace
from lmcache_async.bench.trace.bounds import scan_trace
from lmcache_async.cli import main
from lmcache_async.errors import InvalidInputError

BS = 16
GOOD = {"timestamp": 0, "input_length": 40, "output_length": 3, "hash_ids": [1, 2, 3]}
TINY = ["--layers", "1", "--kv-heads", "2", "--head-size", "16", "--dtype", "float16"]

pytestmark = pytest.mark.usefixtures("restore_logging")


def line(**changes: Any) -> str:
    request = {**GOOD, **changes}
    for name in [name for name, value in changes.items() if value is None]:
        del request[name]
    return json.dumps(request)


BAD: list[tuple[str, str]] = [
    ("{not json", "not JSON"),
    ("[1, 2]", "a request is a JSON object"),
    (line(hash_ids=None), "missing field 'hash_ids'"),
    (line(timestamp=None, output_length=None), "missing field 'timestamp', 'output_length'"),
    (line(input_length=-5), "input_length must be > 0, got -5"),
    (line(input_length=0), "input_length must be > 0, got 0"),
    (line(output_length=-1), "output_length must be >= 0, got -1"),
    (line(timestamp=-3), "timestamp must be >= 0"),
    (line(input_length="40"), "input_length must be an int"),
    (line(input_length=40.0), "input_length must be an int"),
    (line(output_length=True), "output_length must be an int"),
    (line(timestamp="now"), "timestamp must be a number"),
    (line(hash_ids="1,2"), "hash_ids must be a list of ints"),
    (line(hash_ids=[1, "2"]), "hash_ids must be ints"),
    (line(hash_ids=[1, -2]), "hash_ids must be ints"),
    (line(hash_ids=[1, 2, 3, 4]), "hash_ids has 4 blocks, more than the 3 blocks"),
]


@pytest.mark.parametrize(("text", "message"), BAD, ids=[m for _, m in BAD])
def test_each_broken_rule_names_its_line(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "trace.jsonl"
    # Two good requests and a blank line before it: the bad one is on line 4.
    path.write_text(f"{line()}\n\n{line(timestamp=5)}\n{text}\n{line(timestamp=9)}\n")
    with pytest.raises(InvalidInputError, match=r"trace\.jsonl line 4: ") as info:
        list(read_trace(path, block_size=BS))
    assert message in str(info.value)


def test_a_timestamp_that_goes_back_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(f"{line(timestamp=10)}\n{line(timestamp=4)}\n")
    with pytest.raises(InvalidInputError, match=r"t\.jsonl line 2: timestamp 4 is before"):
        list(read_trace(path, block_size=BS))


def test_a_line_past_the_limit_is_never_read(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(f"{line()}\n{line()}\nnot json\n")
    assert [r.line for r in read_trace(path, block_size=BS, limit=2)] == [1, 2]
    with pytest.raises(InvalidInputError, match="line 3"):
        list(read_trace(path, block_size=BS))


def test_fewer_hash_ids_than_blocks_and_other_fields_are_taken(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write(line(hash_ids=[7], session_id="s1") + "\n")
    (request,) = read_trace(path, block_size=BS)
    assert (request.input_length, request.hash_ids, request.full_blocks(BS)) == (40, (7,), 2)


def test_the_cli_refuses_a_bad_line_as_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(f"{line()}\n{line(hash_ids=[1, 2, 3, 4, 5])}\n")
    argv = ["bench", "--trace", str(path), "--trace-block-size", str(BS), *TINY]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "error: bad.jsonl line 2: hash_ids has 5 blocks" in err


def test_the_cli_refuses_a_missing_file_and_bad_settings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "--quiet", "--trace", str(tmp_path / "none.jsonl")]) == 2
    assert "none.jsonl" in capsys.readouterr().err
    path = tmp_path / "t.jsonl"
    path.write_text(line() + "\n")
    for extra, message in (
        (["--speed", "0"], "speed must be > 0"),
        (["--capacities", "1M,lots"], "a capacity is a number of tokens"),
        (["--sweep-replay"], "needs --capacities"),
        (["--chunk-size", "32"], "differs from --trace-block-size"),
        (["--trace-cpu-tokens", "8"], "must hold one block"),
        (["--plot", str(tmp_path / "p.png")], "draws a capacity sweep"),
    ):
        argv = ["bench", "--quiet", "--trace", str(path), "--trace-block-size", str(BS), *extra]
        assert main(argv) == 2, extra
        assert message in capsys.readouterr().err


def test_an_empty_trace_serves_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    assert scan_trace(path, block_size=BS).requests == 0
    out = tmp_path / "empty.json"
    argv = ["bench", "--trace", str(path), "--trace-block-size", str(BS), "--json", str(out)]
    assert main([*argv, *TINY, "--capacities", "64,128"]) == 0
    results = json.loads(out.read_text())
    assert results["trace"]["requests"] == 0
    assert results["bounds"]["unbounded"]["hit_rate"] is None
    assert results["served"]["hit_rate"] is None
    assert results["served"]["requests"] == 0
    assert [row["lru_hit_rate"] for row in results["sweep"]] == [None, None]
    summary = capsys.readouterr().out
    assert "trace, unbounded cache" in summary
    assert re.search(r"served \(tokens loaded by retrieve\) +- ", summary)
