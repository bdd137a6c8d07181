"""The short table at the end of scripts/gpu_check.sh's log: the GPU benchmark's figures
against the baselines measured in the same run, and the CUDA tests' counts.

Usage: ``python scripts/gpu_summary.py BENCH_JSON TESTS_XML``, where BENCH_JSON is what
``lmcache-async bench --gpu --json`` wrote and TESTS_XML pytest's ``--junitxml``. It prints
the D2H store and H2D retrieve GB/s beside their pinned-copy baselines and ratios, the plain
pinned memcpy each way (the link), the share of a layerwise retrieve's transfer hidden behind
compute, and the tests passed, failed, in error and skipped (the failures named).

Either file may be missing or cut short (a step killed at its limit): what is there is
printed and what is not is said, and it still exits 0, so that the summary never changes the
check's outcome. Only the standard library is used: it runs with whatever python ran the
check. Exit status 2: wrong arguments.
"""

from __future__ import annotations

import json
import math
import sys
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["bench_lines", "count_tests", "main", "summary_lines", "table", "tests_line"]

HEADER = ("figure", "measured", "baseline (same run)", "ratio", "target", "status")
MAX_NAMED_FAILURES = 10
# The results other than a pass, worst first: the element a junit test case holds for it,
# and the attribute a junit suite counts it in.
_KINDS = {
    "failed": ("failure", "failures"),
    "errors": ("error", "errors"),
    "skipped": ("skipped", "skipped"),
}


def _finite(value: Any) -> bool:
    """Whether ``value`` is a finite number (the benchmark writes NaN and infinities as
    null)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _number(value: Any, spec: str, suffix: str = "") -> str:
    """``value`` formatted by ``spec`` with ``suffix``, or ``-`` when it is no finite
    number."""
    return format(value, spec) + suffix if _finite(value) else "-"


def _percent(fraction: Any, spec: str) -> str:
    """A fraction as a percentage formatted by ``spec``, or ``-``."""
    return format(fraction * 100, spec) + " %" if _finite(fraction) else "-"


def _part(results: Mapping[str, Any], key: str) -> tuple[Mapping[str, Any] | None, str]:
    """A part's figures, or None and why there are none (not run, or its error)."""
    part = results.get(key)
    if not isinstance(part, Mapping):
        return None, "not run"
    if "error" in part:
        return None, f"FAILED: {part['error']}"
    return part, ""


def _status(results: Mapping[str, Any], part: Mapping[str, Any], ok: Any) -> str:
    """ok / below target on CUDA (n/a on the CPU, where no target applies); a retrieve that
    was not bit-exact is said whatever its speed."""
    said = "ok" if ok is True else "below target"
    if not results.get("cuda"):
        said = "n/a (cpu)"
    if part.get("verified_bit_exact") is False:
        said += ", NOT BIT-EXACT"
    return said


def bench_lines(results: Mapping[str, Any]) -> list[list[str]]:
    """The table's rows of the benchmark's figures (a part that failed or did not run is
    one row saying so)."""
    rows: list[list[str]] = []
    copy, why = _part(results, "copy")
    if copy is None:
        rows.append(["D2H store / H2D retrieve", why, "", "", "", ""])
    else:
        for key, name, baseline in (
            ("d2h", "D2H store", "gather + pinned copy_"),
            ("h2d", "H2D retrieve", "pinned copy_ + scatter"),
        ):
            entry = copy.get(key) or {}
            rows.append(
                [
                    name,
                    _number(entry.get("engine_gbps"), ".1f", " GB/s"),
                    f"{baseline} {_number(entry.get('raw_gbps'), '.1f', ' GB/s')}",
                    _number(entry.get("ratio"), ".2f", "x"),
                    ">= " + _number(entry.get("target_ratio"), ".2f", "x"),
                    _status(results, copy, entry.get("ok")),
                ]
            )
        rows.append(
            [
                "plain pinned memcpy",
                f"D2H {_number(copy.get('memcpy_d2h_gbps'), '.1f')}, "
                f"H2D {_number(copy.get('memcpy_h2d_gbps'), '.1f')} GB/s",
                "",
                "",
                "(the link)",
                "",
            ]
        )
    layerwise, why = _part(results, "layerwise")
    if layerwise is None:
        rows.append(["layerwise hidden", why, "", "", "", ""])
    else:
        rows.append(
            [
                "layerwise hidden",
                _percent(layerwise.get("hidden_fraction"), ".1f"),
                f"serial {_number(layerwise.get('serial_ms'), '.1f', ' ms')}, "
                f"overlapped {_number(layerwise.get('overlap_ms'), '.1f', ' ms')}",
                "",
                ">= " + _percent(layerwise.get("target_hidden"), ".0f"),
                _status(results, layerwise, layerwise.get("ok")),
            ]
        )
    return rows


def _attribute(element: ET.Element, name: str) -> int:
    """A junit count attribute (0 when absent or not a whole number)."""
    try:
        return int(element.get(name, "0"))
    except ValueError:
        return 0


def _result(case: ET.Element) -> str:
    """A test case's result: ``failed``, ``errors``, ``skipped`` or ``passed``."""
    for kind, (tag, _) in _KINDS.items():
        if case.find(tag) is not None:
            return kind
    return "passed"


def count_tests(root: ET.Element) -> tuple[dict[str, int], list[str]]:
    """Passed, failed, error and skipped counts of a junit report, and the tests that failed
    or were in error (``classname::name``). A test counts once, by its worst result: failed,
    in error, skipped, passed (pytest writes a failed test's teardown error as a second case
    of the same name). A report that lists no test cases is counted by its suites' totals."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    cases = list(root.iter("testcase"))
    if not cases:
        for suite in root.iter("testsuite"):
            total = _attribute(suite, "tests")
            for kind, (_, attribute) in _KINDS.items():
                counts[kind] += _attribute(suite, attribute)
                total -= _attribute(suite, attribute)
            counts["passed"] += max(total, 0)
        return counts, []
    worst_first = [*_KINDS, "passed"]
    results: dict[str, str] = {}
    for case in cases:
        name = f"{case.get('classname', '?')}::{case.get('name', '?')}"
        kind = _result(case)
        if name not in results or worst_first.index(kind) < worst_first.index(results[name]):
            results[name] = kind
    for kind in results.values():
        counts[kind] += 1
    return counts, [name for name, kind in results.items() if kind in ("failed", "errors")]


def tests_line(counts: Mapping[str, int]) -> str:
    """``32 passed, 2 failed`` (errors and skipped only when there are some)."""
    said = [f"{counts['passed']} passed", f"{counts['failed']} failed"]
    said += [f"{counts[kind]} {kind}" for kind in ("errors", "skipped") if counts[kind]]
    return ", ".join(said)


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Rows as aligned columns under ``header`` and a rule, trailing spaces trimmed."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(row: Sequence[str]) -> str:
        return "  ".join(
            cell.ljust(width) for cell, width in zip(row, widths, strict=True)
        ).rstrip()

    return [line(header), line(["-" * width for width in widths]), *map(line, rows)]


def _load_bench(path: Path) -> tuple[Mapping[str, Any] | None, str]:
    try:
        results = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None, f"no benchmark figures: {path} is missing"
    except (OSError, ValueError) as exc:
        return None, f"no benchmark figures: {path} is unreadable ({type(exc).__name__}: {exc})"
    if not isinstance(results, Mapping):
        return None, f"no benchmark figures: {path} holds no JSON object"
    return results, ""


def _load_tests(path: Path) -> tuple[ET.Element | None, str]:
    try:
        return ET.parse(path).getroot(), ""
    except FileNotFoundError:
        return None, f"no test counts: {path} is missing"
    except (OSError, ET.ParseError) as exc:
        return None, f"no test counts: {path} is unreadable ({type(exc).__name__}: {exc})"


def summary_lines(bench_json: Path, tests_xml: Path) -> list[str]:
    """The whole summary: a line naming the device, the table, then what is missing, the
    benchmark's problems and the tests that failed."""
    lines: list[str] = []
    notes: list[str] = []
    rows: list[list[str]] = []
    results, why = _load_bench(bench_json)
    if results is None:
        notes.append(why)
    else:
        options = results.get("options") or {}
        copy, _ = _part(results, "copy")
        size = ""
        if copy is not None and _finite(copy.get("bytes")):
            mib = copy["bytes"] / 1024**2
            size = f", {copy.get('tokens', '?')} tokens ({mib:.0f} MiB each way)"
        lines.append(
            f"GPU bench on {results.get('device_name', '?')} ({results.get('device', '?')}), "
            f"torch {results.get('torch_version', '?')}, CUDA {results.get('torch_cuda', '?')}, "
            f"{options.get('num_layers', '?')} layers x {options.get('num_kv_heads', '?')} kv "
            f"heads x {options.get('head_size', '?')} {options.get('dtype', '?')}{size}"
        )
        if results.get("note"):
            lines.append(f"NOTE: {results['note']}")
        rows += bench_lines(results)
        problems = results.get("problems") or []
        if problems:
            notes.append("bench problems: " + "; ".join(map(str, problems)))
    root, why = _load_tests(tests_xml)
    if root is None:
        notes.append(why)
    else:
        counts, failed = count_tests(root)
        rows.append(["CUDA tests", tests_line(counts), "", "", "", ""])
        if failed:
            named = failed[:MAX_NAMED_FAILURES]
            more = len(failed) - len(named)
            notes.append("failed: " + ", ".join(named) + (f" and {more} more" if more > 0 else ""))
    if rows:
        lines += table(HEADER, rows)
    return lines + notes


def main(argv: Sequence[str] | None = None) -> int:
    """Print the summary of ``BENCH_JSON TESTS_XML``; 0, or 2 for wrong arguments."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print("usage: gpu_summary.py BENCH_JSON TESTS_XML", file=sys.stderr)
        return 2
    for line in summary_lines(Path(args[0]), Path(args[1])):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
