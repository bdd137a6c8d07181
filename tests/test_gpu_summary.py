"""scripts/gpu_summary.py, the table at the end of scripts/gpu_check.sh's log: it reads the
JSON the GPU benchmark writes (made here by the benchmark itself, on the CPU, then given the
figures of a GPU run) and the junit report pytest writes, and prints D2H and H2D against their
same-run baselines, the plain memcpy, the share of a layerwise retrieve hidden and the tests'
counts; a file missing or cut short is said, never fatal."""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from lmcache_async import EngineConfig
from lmcache_async.bench import write_json
from lmcache_async.bench.gpu import GpuOptions, run_gpu_bench

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_summary.py"


def _load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_summary", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


summary = _load_script()


def junit(cases: str) -> str:
    """A junit report as pytest writes it, holding ``cases`` (its suite totals are not
    what is counted)."""
    return (
        '<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests">'
        '<testsuite name="pytest" errors="0" failures="0" skipped="0" tests="0" time="1.0" '
        f'timestamp="2026-12-06T00:00:00" hostname="gpu">{cases}</testsuite></testsuites>'
    )


def case(name: str, inner: str = "") -> str:
    return (
        f'<testcase classname="tests.memory.test_pool" name="{name}" time="0.1">{inner}</testcase>'
    )


@pytest.fixture(scope="module")
def cpu_run() -> tuple[dict[str, Any], dict[str, Any]]:
    """A CPU run of the benchmark at a tiny size, and the results it saved after its first
    part (what a run killed during its second part leaves)."""
    saved: list[dict[str, Any]] = []
    options = GpuOptions(
        tokens=32, repeat=1, num_layers=2, num_kv_heads=1, head_size=16, device="cpu"
    )
    results = run_gpu_bench(
        options, EngineConfig(), checkpoint=lambda r: saved.append(copy.deepcopy(dict(r)))
    )
    return results, saved[0]


def as_on_the_h100(results: Mapping[str, Any]) -> dict[str, Any]:
    """``results`` with the figures and device of the issue's H100 run."""
    gpu = copy.deepcopy(dict(results))
    gpu.update(
        cuda=True,
        device="cuda:0",
        device_name="NVIDIA H100 80GB HBM3",
        torch_version="2.11.0+cu130",
        torch_cuda="13.0",
        note=None,
    )
    gpu["options"].update(num_layers=32, num_kv_heads=8, head_size=128, tokens=8192)
    gpu["copy"].update(tokens=8192, bytes=1 << 30, memcpy_d2h_gbps=54.6, memcpy_h2d_gbps=51.7)
    gpu["copy"]["d2h"].update(engine_gbps=34.3, raw_gbps=50.6, ratio=34.3 / 50.6, ok=False)
    gpu["copy"]["h2d"].update(engine_gbps=36.7, raw_gbps=46.2, ratio=36.7 / 46.2, ok=False)
    gpu["layerwise"].update(
        hidden_fraction=0.069, serial_ms=94.7, overlap_ms=90.9, target_hidden=0.7, ok=False
    )
    return gpu


def written(tmp_path: Path, results: Mapping[str, Any] | str, report: str) -> tuple[Path, Path]:
    """``results`` written as the benchmark writes them (or raw text) and ``report``."""
    bench, tests = tmp_path / "gpu_bench.json", tmp_path / "gpu_tests.xml"
    if isinstance(results, str):
        bench.write_text(results)
    else:
        write_json(bench, results)
    tests.write_text(report)
    return bench, tests


def rows(lines: list[str]) -> dict[str, str]:
    """The table's rows by their figure, each with its columns' spacing collapsed to " | "."""
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["figure", "measured"])
    widths = [len(rule) for rule in lines[start + 1].split("  ")]
    found: dict[str, str] = {}
    for line in lines[start + 2 :]:
        if not line.startswith(("D2H", "H2D", "plain", "layerwise", "CUDA")):
            break
        cells, at = [], 0
        for width in widths:
            cells.append(line[at : at + width].strip())
            at += width + 2
        found[cells[0]] = " | ".join(cells[1:])
    return found


def test_the_h100_figures_print_as_the_issue_lists_them(
    tmp_path: Path, cpu_run: tuple[dict[str, Any], dict[str, Any]]
) -> None:
    failure = '<failure message="assert False">trace</failure>'
    report = junit(
        "".join(case(f"test_{i}") for i in range(32))
        + case("test_pinned", failure)
        + case("test_three_gib", failure)
        + case("test_skipped", '<skipped type="pytest.skip" message="no">s</skipped>')
    )
    bench, tests = written(tmp_path, as_on_the_h100(cpu_run[0]), report)

    lines = summary.summary_lines(bench, tests)

    assert lines[0] == (
        "GPU bench on NVIDIA H100 80GB HBM3 (cuda:0), torch 2.11.0+cu130, CUDA 13.0, 32 layers "
        "x 8 kv heads x 128 bfloat16, 8192 tokens (1024 MiB each way)"
    )
    assert rows(lines) == {
        "D2H store": "34.3 GB/s | gather + pinned copy_ 50.6 GB/s | 0.68x | >= 0.90x | "
        "below target",
        "H2D retrieve": "36.7 GB/s | pinned copy_ + scatter 46.2 GB/s | 0.79x | >= 0.90x | "
        "below target",
        "plain pinned memcpy": "D2H 54.6, H2D 51.7 GB/s |  |  | (the link) | ",
        "layerwise hidden": "6.9 % | serial 94.7 ms, overlapped 90.9 ms |  | >= 70 % | "
        "below target",
        "CUDA tests": "32 passed, 2 failed, 1 skipped |  |  |  | ",
    }
    assert lines[-1] == (
        "failed: tests.memory.test_pool::test_pinned, tests.memory.test_pool::test_three_gib"
    )


def test_figures_at_their_targets_are_ok_and_a_wrong_copy_is_said(
    tmp_path: Path, cpu_run: tuple[dict[str, Any], dict[str, Any]]
) -> None:
    results = as_on_the_h100(cpu_run[0])
    results["copy"]["h2d"].update(engine_gbps=46.5, ratio=46.5 / 46.2, ok=True)
    results["layerwise"].update(hidden_fraction=0.75, ok=True, verified_bit_exact=False)
    bench, tests = written(tmp_path, results, junit(case("test_a")))

    table = rows(summary.summary_lines(bench, tests))

    assert (
        table["H2D retrieve"]
        == "46.5 GB/s | pinned copy_ + scatter 46.2 GB/s | 1.01x | >= 0.90x | ok"
    )
    assert table["layerwise hidden"].startswith("75.0 % |")
    assert table["layerwise hidden"].endswith("| >= 70 % | ok, NOT BIT-EXACT")


def test_a_cpu_run_says_its_figures_are_no_gpus(
    tmp_path: Path, cpu_run: tuple[dict[str, Any], dict[str, Any]]
) -> None:
    bench, tests = written(tmp_path, cpu_run[0], junit(case("test_a")))

    lines = summary.summary_lines(bench, tests)

    assert lines[0].startswith("GPU bench on cpu (cpu), torch ")
    assert lines[1].startswith("NOTE: no CUDA device")
    table = rows(lines)
    assert list(table) == [
        "D2H store",
        "H2D retrieve",
        "plain pinned memcpy",
        "layerwise hidden",
        "CUDA tests",
    ]
    for figure in ("D2H store", "H2D retrieve", "layerwise hidden"):
        assert table[figure].endswith("| n/a (cpu)"), table[figure]
    assert table["CUDA tests"].startswith("1 passed, 0 failed |")


def test_a_run_cut_short_prints_what_it_has(
    tmp_path: Path, cpu_run: tuple[dict[str, Any], dict[str, Any]]
) -> None:
    """The JSON saved after the copies (the run killed later) and a part that failed."""
    first = cpu_run[1]
    assert first["copy"] is not None
    assert first["layerwise"] is None
    bench, tests = written(tmp_path, first, junit(""))

    table = rows(summary.summary_lines(bench, tests))

    assert table["layerwise hidden"] == "not run |  |  |  | "
    assert re.match(r"\d+\.\d GB/s \| gather \+ pinned copy_ \d+\.\d GB/s \|", table["D2H store"])
    error = "RuntimeError: boom"
    failed = dict(
        cpu_run[0],
        copy={"error": error, "problems": [f"copy failed: {error}"]},
        problems=[f"copy failed: {error}"],
    )
    bench, tests = written(tmp_path, failed, junit(""))

    lines = summary.summary_lines(bench, tests)

    assert rows(lines)["D2H store / H2D retrieve"].startswith("FAILED: RuntimeError: boom |")
    assert "bench problems: copy failed: RuntimeError: boom" in lines


def test_figures_written_as_null_print_as_a_dash(
    tmp_path: Path, cpu_run: tuple[dict[str, Any], dict[str, Any]]
) -> None:
    results = as_on_the_h100(cpu_run[0])
    results["copy"]["d2h"].update(engine_gbps=float("nan"), ratio=float("inf"))
    results["layerwise"]["hidden_fraction"] = float("nan")
    bench, tests = written(tmp_path, results, junit(""))
    assert json.loads(bench.read_text())["copy"]["d2h"]["engine_gbps"] is None

    table = rows(summary.summary_lines(bench, tests))

    assert table["D2H store"].startswith("- | gather + pinned copy_ 50.6 GB/s | - |")
    assert table["layerwise hidden"].startswith("- | serial 94.7 ms")


@pytest.mark.parametrize(
    ("make", "said"),
    [
        (lambda b, t: b.unlink(), "no benchmark figures: {bench} is missing"),
        (
            lambda b, t: b.write_text('{"copy": {"d2h"'),
            "no benchmark figures: {bench} is unreadable",
        ),
        (lambda b, t: b.write_text("[]"), "no benchmark figures: {bench} holds no JSON object"),
        (lambda b, t: t.unlink(), "no test counts: {tests} is missing"),
        (lambda b, t: t.write_text("<testsuites"), "no test counts: {tests} is unreadable"),
    ],
    ids=["no-json", "json-cut-short", "json-not-an-object", "no-junit", "junit-cut-short"],
)
def test_a_missing_or_broken_file_is_said_and_the_rest_printed(
    tmp_path: Path,
    cpu_run: tuple[dict[str, Any], dict[str, Any]],
    make: Callable[[Path, Path], object],
    said: str,
) -> None:
    bench, tests = written(tmp_path, as_on_the_h100(cpu_run[0]), junit(case("test_a")))
    make(bench, tests)

    lines = summary.summary_lines(bench, tests)

    expected = said.format(bench=bench, tests=tests)
    assert [line for line in lines if line.startswith(expected)] != [], lines
    table = rows(lines)
    assert ("D2H store" in table) is ("benchmark" not in said)
    assert ("CUDA tests" in table) is ("test counts" not in said)


def test_the_benchmarks_own_empty_json_is_no_figures(tmp_path: Path) -> None:
    bench, tests = written(tmp_path, "{}", junit(case("test_a")))

    table = rows(summary.summary_lines(bench, tests))

    assert table["D2H store / H2D retrieve"] == "not run |  |  |  | "
    assert table["layerwise hidden"] == "not run |  |  |  | "
    assert table["CUDA tests"] == "1 passed, 0 failed |  |  |  | "


def test_a_report_without_test_cases_is_counted_by_its_totals(tmp_path: Path) -> None:
    report = (
        '<testsuites><testsuite errors="1" failures="2" skipped="3" tests="10" />'
        '<testsuite errors="0" failures="0" skipped="0" tests="4" /></testsuites>'
    )
    bench, tests = written(tmp_path, "{}", report)

    table = rows(summary.summary_lines(bench, tests))

    assert table["CUDA tests"] == "8 passed, 2 failed, 1 errors, 3 skipped |  |  |  | "


@pytest.mark.subprocess
def test_pytests_own_report_is_counted_once_per_test(tmp_path: Path) -> None:
    """A real pytest run: a pass, a failure whose teardown also fails (one test, failed), a
    setup error, a skip and an expected failure (skipped)."""
    (tmp_path / "test_mixed.py").write_text(
        textwrap.dedent(
            """
            import pytest

            @pytest.fixture
            def broken_teardown():
                yield
                raise RuntimeError("teardown")

            @pytest.fixture
            def broken_setup():
                raise RuntimeError("setup")

            def test_passes():
                pass

            def test_fails(broken_teardown):
                assert False

            def test_setup_error(broken_setup):
                pass

            def test_skips():
                pytest.skip("no device")

            @pytest.mark.xfail(reason="known")
            def test_xfails():
                assert False
            """
        )
    )
    report = tmp_path / "report.xml"
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
         f"--junitxml={report}", str(tmp_path / "test_mixed.py")],
        cwd=tmp_path,
        capture_output=True,
        timeout=120,
        check=False,
    )  # fmt: skip
    bench, _ = written(tmp_path, "{}", "")

    lines = summary.summary_lines(bench, report)

    assert rows(lines)["CUDA tests"] == "1 passed, 1 failed, 1 errors, 2 skipped |  |  |  | "
    assert lines[-1] == "failed: test_mixed::test_fails, test_mixed::test_setup_error"


@pytest.mark.subprocess
def test_run_as_a_script_it_prints_the_table_and_exits_0(
    tmp_path: Path, cpu_run: tuple[dict[str, Any], dict[str, Any]]
) -> None:
    bench, tests = written(tmp_path, as_on_the_h100(cpu_run[0]), junit(case("test_a")))

    proc = subprocess.run(
        [sys.executable, "-I", str(SCRIPT), str(bench), str(tests)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    missing = subprocess.run(
        [sys.executable, "-I", str(SCRIPT), str(tmp_path / "none.json"), str(tmp_path / "n.xml")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    usage = subprocess.run(
        [sys.executable, "-I", str(SCRIPT), str(bench)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )

    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == summary.summary_lines(bench, tests)
    assert "D2H store" in proc.stdout
    assert missing.returncode == 0, missing.stderr
    assert missing.stdout.splitlines() == [
        f"no benchmark figures: {tmp_path / 'none.json'} is missing",
        f"no test counts: {tmp_path / 'n.xml'} is missing",
    ]
    assert usage.returncode == 2
    assert usage.stdout == ""
    assert "usage: gpu_summary.py BENCH_JSON TESTS_XML" in usage.stderr
