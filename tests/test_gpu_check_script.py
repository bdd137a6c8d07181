"""scripts/gpu_check.sh on a machine without a GPU: it prints every dependency's version and
checks it and the imports first, then stops with a clear "no CUDA device" and its own exit
status, and logs what it printed under $OUT. Every python runs unbuffered and with
faulthandler, each test's timeout is well under the tests' budget, and (with a python that
claims a device) the tests and the benchmark write their summary and figures to $OUT."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.sh"
# The most the script may take on a GPU machine, and what its steps before the tests take
# at most there (wheels, imports, the device probe).
WHOLE_BUDGET = 480
SET_UP = 60

pytestmark = [
    pytest.mark.skipif(
        torch.cuda.is_available(), reason="with a GPU the script runs the whole check"
    ),
]


def _run(
    tmp_path: Path, *, cwd: Path | None = None, out: Path | None = None, **env: str
) -> tuple[subprocess.CompletedProcess[str], str]:
    """Run the script with a CPU python, no wheels and its output under ``tmp_path / "out"``
    (or ``out``, relative to ``cwd``)."""
    out = out if out is not None else tmp_path / "out"
    empty = tmp_path / "no-wheels"
    empty.mkdir(exist_ok=True)
    full_env = {
        **os.environ,
        "PYTHON": sys.executable,
        "OUT": str(out),
        "WHEELS_DIR": str(empty),
        **env,
    }
    proc = subprocess.run(
        ["bash", str(SCRIPT)],
        env=full_env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    log = ((cwd or REPO) / out / "gpu_check.log").read_text()
    return proc, log


def _shim(tmp_path: Path, *, claim_a_device: bool = False) -> tuple[Path, Path]:
    """A python that records how it is called (the unbuffered and faulthandler variables,
    then its first three arguments) and runs this python; with ``claim_a_device`` it answers
    the script's device probe as if a GPU were there. Returns the shim and its record."""
    calls = tmp_path / "calls"
    shim = tmp_path / "python"
    probe = (
        'for arg; do [[ $arg == *"torch.cuda.is_available()"* ]] && '
        "{ echo 'torch 0, CUDA build fake, device Fake GPU'; exit 0; }; done\n"
        if claim_a_device
        else ""
    )
    shim.write_text(
        "#!/usr/bin/env bash\n"
        'printf \'%s %s|%s %s %s\\n\' "${PYTHONUNBUFFERED:-}" "${PYTHONFAULTHANDLER:-}" '
        f'"$1" "$2" "$3" >>{calls}\n'
        f"{probe}"
        f'exec {sys.executable} "$@"\n'
    )
    shim.chmod(0o755)
    return shim, calls


def _default(name: str) -> int:
    """The default the script gives the variable ``name`` (or its value, if it is fixed)."""
    match = re.search(rf"^{name}=(?:\$\{{{name}:-)?([0-9]+)\}}?$", SCRIPT.read_text(), re.M)
    assert match is not None, name
    return int(match.group(1))


def test_script_is_executable_bash_with_strict_mode() -> None:
    assert os.access(SCRIPT, os.X_OK)
    lines = SCRIPT.read_text().splitlines()
    assert lines[0] == "#!/usr/bin/env bash"
    assert "set -euo pipefail" in lines


@pytest.mark.subprocess
@pytest.mark.slow
def test_without_a_gpu_it_fails_clearly_after_checking_imports(tmp_path: Path) -> None:
    proc, log = _run(tmp_path)

    assert proc.returncode == 3, proc.stdout + proc.stderr
    out = proc.stdout
    assert "imports ok: " in out
    assert "lmcache_async" in out.split("imports ok: ", 1)[1].splitlines()[0]
    assert "gpu_check: FAILED: no CUDA device: torch " in out
    assert out.index("imports ok") < out.index("no CUDA device")
    assert out.rstrip().splitlines()[-1].startswith("gpu_check: FAILED: no CUDA device")
    # Nothing past the device check ran, and the log holds what was printed.
    assert "CUDA tests" not in out
    assert "GPU bench" not in out
    assert not (tmp_path / "out" / "gpu_bench.json").exists()
    assert "gpu_check: FAILED: no CUDA device" in log
    assert "imports ok: " in log


@pytest.mark.subprocess
@pytest.mark.slow
def test_a_missing_import_is_named_before_the_device_is_probed(tmp_path: Path) -> None:
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "blake3.py").write_text('raise ImportError("not installed here")\n')

    proc, log = _run(tmp_path, PYTHONPATH=str(shadow))

    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "missing imports: blake3 (import blake3: ImportError: not installed here)" in proc.stdout
    assert "make gpu-wheels" in proc.stdout
    assert "no CUDA device" not in proc.stdout
    assert "missing imports: blake3" in log


@pytest.mark.subprocess
def test_an_unusable_python_is_refused(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-python"

    proc, log = _run(tmp_path, PYTHON=str(missing))

    assert proc.returncode == 2
    assert f"gpu_check: FAILED: PYTHON={missing} is not an executable" in proc.stdout
    assert "is not an executable" in log


def test_every_python_call_is_unbuffered_with_faulthandler() -> None:
    text = SCRIPT.read_text()
    assert "PY_FLAGS=(-u -X faulthandler)" in text
    assert "export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1" in text
    calls = re.findall(r'(?<!command -v )"\$(?:PY|cand)" (\S+)', text)
    # pick_python's two probes, the version, pip and its fallback, the imports, the device
    # probe, the tests and the benchmark.
    assert len(calls) >= 9, calls
    assert set(calls) == {'"${PY_FLAGS[@]}"'}, calls


@pytest.mark.subprocess
@pytest.mark.slow
def test_the_dry_run_calls_python_unbuffered_with_faulthandler(tmp_path: Path) -> None:
    shim, calls = _shim(tmp_path)

    proc, _ = _run(tmp_path, PYTHON=str(shim))

    assert proc.returncode == 3, proc.stdout + proc.stderr
    recorded = calls.read_text().splitlines()
    # The version, the imports and the device probe.
    assert len(recorded) == 3, recorded
    assert set(recorded) == {"1 1|-u -X faulthandler"}, recorded


def test_each_test_times_out_well_under_the_budget_and_all_fits_the_machine() -> None:
    text = SCRIPT.read_text()
    per_test, budget = _default("PER_TEST_TIMEOUT"), _default("TEST_TIMEOUT")
    bench, grace = _default("BENCH_TIMEOUT"), _default("GRACE")
    assert 2 * per_test <= budget
    assert '--timeout="$PER_TEST_TIMEOUT" --timeout-method=signal' in text
    assert "--session-timeout=$((TEST_TIMEOUT - PER_TEST_TIMEOUT - GRACE))" in text
    assert "-o faulthandler_timeout=$((PER_TEST_TIMEOUT - 5))" in text
    # pytest's own per-test timeout from pyproject.toml would be longer than the budget:
    # the command line must set it.
    ini = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert ini["timeout"] > per_test
    assert SET_UP + budget + bench + 2 * grace <= WHOLE_BUDGET


@pytest.mark.subprocess
def test_a_per_test_timeout_over_half_the_budget_is_refused(tmp_path: Path) -> None:
    proc, log = _run(tmp_path, TEST_TIMEOUT="100", PER_TEST_TIMEOUT="60")

    assert proc.returncode == 2
    message = "FAILED: PER_TEST_TIMEOUT=60 must be at most half of TEST_TIMEOUT=100"
    assert message in proc.stdout
    assert message in log


@pytest.mark.subprocess
@pytest.mark.slow
def test_a_relative_out_is_taken_from_the_callers_directory(tmp_path: Path) -> None:
    proc, log = _run(tmp_path, cwd=tmp_path, out=Path("rel") / "out")

    assert proc.returncode == 3, proc.stdout + proc.stderr
    out = tmp_path / "rel" / "out"
    assert f"output in {out}" in log
    assert "FAILED: no CUDA device" in log
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.log"]


@pytest.mark.subprocess
@pytest.mark.slow
def test_the_dry_run_prints_every_dependencys_version(tmp_path: Path) -> None:
    proc, _ = _run(tmp_path)

    assert proc.returncode == 3, proc.stdout + proc.stderr
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for requirement in [*project["dependencies"], "pytest>=8.0", "pytest-timeout>=2.3"]:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9.]+)", requirement)
        assert match is not None, requirement
        name, minimum = match.groups()
        dist = name.lower().replace("_", "-")
        assert re.search(rf"^version: {dist} \S+ >= {minimum} ok", proc.stdout, re.M), dist
    assert re.search(r"^version: torch \S+ >= \S+ ok \(CUDA build ", proc.stdout, re.M)


@pytest.mark.subprocess
@pytest.mark.slow
def test_a_package_older_than_pyproject_asks_is_refused(tmp_path: Path) -> None:
    # An older msgpack's metadata, found first on the path.
    shadow = tmp_path / "shadow"
    info = shadow / "msgpack-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: msgpack\nVersion: 0.1\n")

    proc, log = _run(tmp_path, PYTHONPATH=str(shadow))

    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "version: msgpack 0.1 >= 1.0 TOO OLD" in proc.stdout
    assert "too old: msgpack 0.1 (pyproject.toml asks >= 1.0)" in proc.stdout
    assert "older than pyproject.toml asks" in proc.stdout
    assert "make gpu-wheels" in proc.stdout
    assert "imports ok" not in proc.stdout
    assert "no CUDA device" not in proc.stdout
    assert "too old: msgpack 0.1" in log


@pytest.mark.subprocess
@pytest.mark.slow
def test_past_the_device_check_the_summary_and_figures_land_in_out(tmp_path: Path) -> None:
    # A python that claims a device: the CUDA tests are collected and skip (this torch has
    # none), and the benchmark runs on the CPU at a small size.
    shim, calls = _shim(tmp_path, claim_a_device=True)

    proc, log = _run(tmp_path, PYTHON=str(shim), BENCH_DEVICE="cpu", BENCH_TOKENS="64")

    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == [
        "gpu_bench.json",
        "gpu_check.log",
        "gpu_tests.xml",
    ]
    assert "session timeout: 95" in log
    assert 'skipped="' in (out / "gpu_tests.xml").read_text()
    figures = json.loads((out / "gpu_bench.json").read_text())
    assert figures["copy"]["verified_bit_exact"] is True
    assert figures["layerwise"]["verified_bit_exact"] is True
    assert figures["staged"]["verified_bit_exact"] is True
    assert log.count("gpu_bench_part_done") == 3
    assert "CUDA tests: passed; bench: passed;" in log
    assert set(calls.read_text().splitlines()) == {"1 1|-u -X faulthandler"}
