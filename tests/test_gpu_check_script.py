"""scripts/gpu_check.sh on a machine without a GPU: it prints every dependency's version and
checks it and the imports first, then stops with a clear "no CUDA device" and its own exit
status, and logs what it printed under $OUT. Past the device check (a python that claims a
device) every python runs unbuffered and with faulthandler, pytest gets per-test and session
timeouts that fit the machine's budget, the summary and figures land in $OUT, and a run in
which no CUDA test ran (all skipped, or none collected) fails and says so."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.sh"
FAKE_PYTHON = Path(__file__).with_name("fake_gpu_python.py")
# The most the script may take on a GPU machine, and what its steps before the tests take
# at most there (wheels, imports, the device probe).
WHOLE_BUDGET = 480
SET_UP = 60
# Seconds the script lets a step run past its limit before it is killed.
GRACE = 15

pytestmark = [
    pytest.mark.skipif(
        torch.cuda.is_available(), reason="with a GPU the script runs the whole check"
    ),
]


def _run(
    tmp_path: Path, *, cwd: Path | None = None, out: Path | None = None, **env: str | None
) -> tuple[subprocess.CompletedProcess[str], str]:
    """Run the script with a CPU python, no wheels and its output under ``tmp_path / "out"``
    (or ``out``, relative to ``cwd``); a variable given as None is unset."""
    out = out if out is not None else tmp_path / "out"
    empty = tmp_path / "no-wheels"
    empty.mkdir(exist_ok=True)
    settings = {
        "PYTHON": sys.executable,
        "OUT": str(out),
        "WHEELS_DIR": str(empty),
        # What the script's pythons see of these is what the script sets.
        "PYTHONUNBUFFERED": None,
        "PYTHONFAULTHANDLER": None,
        **env,
    }
    full_env = {k: v for k, v in {**os.environ, **settings}.items() if v is not None}
    proc = subprocess.run(
        ["bash", str(SCRIPT)],
        env=full_env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=240,
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


@dataclass
class Fakes:
    """A stand-in python (``bin/python3``) and ``timeout`` (``bin/timeout``), and what was
    asked of them."""

    bin: Path
    calls_path: Path
    timeouts_path: Path

    @property
    def python(self) -> Path:
        return self.bin / "python3"

    def calls(self) -> list[list[str]]:
        """Each python call's arguments, in order."""
        return [entry["args"] for entry in self._entries()]

    def envs(self) -> list[list[str | None]]:
        """PYTHONUNBUFFERED and PYTHONFAULTHANDLER as each python call saw them."""
        return [entry["env"] for entry in self._entries()]

    def timeouts(self) -> list[str]:
        """Each ``timeout`` call's options and limit, and the module its python ran."""
        return self.timeouts_path.read_text().splitlines()

    def _entries(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.calls_path.read_text().splitlines()]


def _fakes(
    tmp_path: Path,
    *,
    device: bool = True,
    cuda_build: bool = True,
    pip: bool = True,
    tests: int = 3,
    skipped: int = 0,
    junit: bool = True,
    pytest_exit: int = 0,
    bench_exit: int = 0,
) -> Fakes:
    """A python that answers each of the script's calls at once, as configured: whether it
    has a CUDA build and pip, whether the device probe finds a device, the junit summary its
    pytest writes (``tests`` of which ``skipped``, or none) and the exit statuses of its
    pytest and benchmark; and a ``timeout`` that records its arguments and runs the command
    under the real one."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fakes = Fakes(bin_dir, tmp_path / "calls.jsonl", tmp_path / "timeouts")
    fakes.calls_path.touch()
    fakes.timeouts_path.touch()
    config = {
        "calls": str(fakes.calls_path),
        "device": device,
        "cuda_build": cuda_build,
        "pip": pip,
        "tests": tests,
        "skipped": skipped,
        "junit": junit,
        "pytest_exit": pytest_exit,
        "bench_exit": bench_exit,
    }
    config_path = tmp_path / "fake_python.json"
    config_path.write_text(json.dumps(config))
    fakes.python.write_text(
        f'#!/usr/bin/env bash\nexec {sys.executable} -I {FAKE_PYTHON} {config_path} "$@"\n'
    )
    real_timeout = shutil.which("timeout")
    assert real_timeout is not None
    record = '"$1 $2 $3 $4 $5 ${11}"'  # options, limit, and the module the python runs
    (bin_dir / "timeout").write_text(
        f"#!/usr/bin/env bash\nprintf '%s\\n' {record} >>{fakes.timeouts_path}\n"
        f'exec {real_timeout} "$@"\n'
    )
    for name in ("python3", "timeout"):
        (bin_dir / name).chmod(0o755)
    return fakes


def _run_fakes(tmp_path: Path, fakes: Fakes, **env: str | None) -> tuple[str, str, int]:
    """Run the script with ``fakes`` first on PATH and their python as PYTHON; its output,
    log and exit status."""
    path = f"{fakes.bin}:{os.environ['PATH']}"
    variables: dict[str, Any] = {"PATH": path, "PYTHON": str(fakes.python), **env}
    proc, log = _run(tmp_path, **variables)
    return proc.stdout + proc.stderr, log, proc.returncode


@pytest.mark.subprocess
def test_run_as_a_command_it_stops_at_the_first_step_that_fails(tmp_path: Path) -> None:
    """Run by its own path (its #! line), the script stops where a step fails, with that
    step's status: an OUT that cannot be made ends it before it prints anything."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = blocker / "out"

    proc = subprocess.run(
        [str(SCRIPT)],
        env={**os.environ, "PYTHON": sys.executable, "OUT": str(out), "LC_ALL": "C"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )

    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout == ""
    assert "mkdir" in proc.stderr
    assert "Not a directory" in proc.stderr
    assert blocker.read_text() == ""


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


@pytest.mark.subprocess
@pytest.mark.skipif(
    Path("/opt/torch/.venv/bin/python3").exists(), reason="the script would pick that python"
)
@pytest.mark.parametrize("pip", [True, False], ids=["pip", "no-pip"])
def test_every_python_call_is_unbuffered_with_faulthandler(tmp_path: Path, pip: bool) -> None:
    """Every python the script starts, from picking one to the benchmark, gets ``-u -X
    faulthandler`` and the two variables (for what it starts in turn)."""
    fakes = _fakes(tmp_path, cuda_build=False, pip=pip)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "tiny-1.0-py3-none-any.whl").write_bytes(b"")

    output, _, status = _run_fakes(
        tmp_path,
        fakes,
        PYTHON=None,
        WHEELS_DIR=str(wheels),
        GPU_CHECK_SITE=str(tmp_path / "site"),
    )

    assert status == 0, output
    assert f"python: {fakes.python.name} (3.12.0)" in output
    calls = fakes.calls()
    install = ["-m", "pip", "install"] if pip else ["-c"]
    steps = [
        ["-c", "import sys, torch; sys.exit(0 if torch.version.cuda else 1)"],
        ["-c", "import torch"],
        ["-c", "import sys; print(sys.version.split()[0])"],
        ["-m", "pip", "--version"],
        install,
        ["-"],
        ["-c"],  # the device probe
        ["-m", "pytest"],
        ["-c"],  # the count of the tests that ran
        ["-m", "lmcache_async.cli"],
        ["scripts/gpu_summary.py"],
    ]
    assert len(calls) == len(steps), calls
    for call, step in zip(calls, steps, strict=True):
        assert call[:3] == ["-u", "-X", "faulthandler"], call
        assert call[3 : 3 + len(step)] == step, call
    assert "is_available" in calls[6][4]
    assert "xml.etree" in calls[8][4]
    if not pip:
        assert "zipfile" in calls[4][4]
    assert fakes.envs() == [["1", "1"]] * len(steps)


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


@pytest.mark.subprocess
@pytest.mark.parametrize(
    ("env", "limits"),
    [
        ({}, (60, 170, 95, 55, 150)),
        (
            {"TEST_TIMEOUT": "100", "PER_TEST_TIMEOUT": "50", "BENCH_TIMEOUT": "30"},
            (50, 100, 35, 45, 30),
        ),
    ],
    ids=["defaults", "set"],
)
def test_each_test_times_out_well_under_the_budget_and_all_fits_the_machine(
    tmp_path: Path, env: dict[str, str], limits: tuple[int, int, int, int, int]
) -> None:
    """pytest gets a per-test timeout (signal method, stacks dumped 5 s before), and stops
    starting tests once one more could overrun its budget; the tests and the benchmark run
    under ``timeout`` with a grace period; with the defaults all of it fits the machine."""
    per_test, budget, session, stacks, bench = limits
    fakes = _fakes(tmp_path)

    output, log, status = _run_fakes(tmp_path, fakes, **env)

    assert status == 0, output
    pytest_call = next(call for call in fakes.calls() if call[3:5] == ["-m", "pytest"])
    options = " ".join(pytest_call)
    assert f"--timeout={per_test} --timeout-method=signal" in options
    assert f"--session-timeout={session} " in options
    assert f"-o faulthandler_timeout={stacks} " in options
    assert f"CUDA tests ({budget}s in all, {per_test}s each)" in log
    # No test starts once it could run past the budget with its grace period.
    assert session + per_test + GRACE == budget
    assert fakes.timeouts() == [
        f"-s INT -k {GRACE} {budget} pytest",
        f"-s ABRT -k {GRACE} {bench} lmcache_async.cli",
    ]
    assert 2 * per_test <= budget
    # pytest's own per-test timeout from pyproject.toml is longer than the budget allows:
    # the command line above is what sets it.
    ini = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert ini["timeout"] > per_test
    if not env:
        assert SET_UP + budget + bench + 2 * GRACE <= WHOLE_BUDGET


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
    """With a python that claims a device, the tests run against a CPU torch: every CUDA test
    skips, so the script says no CUDA test ran and fails, after the benchmark (on the CPU,
    at a small size) has written its figures."""
    shim, calls = _shim(tmp_path, claim_a_device=True)

    proc, log = _run(tmp_path, PYTHON=str(shim), BENCH_DEVICE="cpu", BENCH_TOKENS="64")

    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == [
        "gpu_bench.json",
        "gpu_check.log",
        "gpu_tests.xml",
    ]
    assert "session timeout: 95" in log
    suite = ElementTree.parse(out / "gpu_tests.xml").getroot().find("testsuite")
    assert suite is not None
    assert int(suite.get("tests", "0")) > 0
    assert suite.get("skipped") == suite.get("tests")
    assert "gpu_check: no CUDA test ran: every one was skipped" in log
    figures = json.loads((out / "gpu_bench.json").read_text())
    assert figures["copy"]["verified_bit_exact"] is True
    assert figures["layerwise"]["verified_bit_exact"] is True
    assert figures["staged"]["verified_bit_exact"] is True
    assert log.count("gpu_bench_part_done") == 3
    # The summary's table, read back from the two files, ends the log before the verdict.
    summary = log.split("gpu_check: summary of gpu_bench.json and gpu_tests.xml:\n", 1)[1]
    for figure in ("D2H store", "H2D retrieve", "plain pinned memcpy", "layerwise hidden"):
        assert re.search(rf"^{figure} .* n/a \(cpu\)$|^{figure} .*\(the link\)$", summary, re.M)
    assert re.search(
        rf"^CUDA tests +0 passed, 0 failed, {suite.get('tests')} skipped$", summary, re.M
    )
    last = proc.stdout.rstrip().splitlines()[-1]
    assert last.startswith("gpu_check: CUDA tests: no CUDA test ran; bench: passed;"), last
    assert set(calls.read_text().splitlines()) == {"1 1|-u -X faulthandler"}


@pytest.mark.subprocess
@pytest.mark.parametrize(
    ("fake", "said", "status", "tests_said"),
    [
        ({"tests": 3, "skipped": 2}, None, 0, "passed"),
        ({"tests": 3, "skipped": 3}, "every one was skipped", 1, "no CUDA test ran"),
        ({"tests": 0, "pytest_exit": 5}, "pytest collected none", 1, "no CUDA test ran"),
        ({"junit": False}, "no readable junit summary in ", 1, "no CUDA test ran"),
        ({"tests": 3, "pytest_exit": 1}, None, 1, "failed (1)"),
    ],
    ids=["one-ran", "all-skipped", "none-collected", "no-summary", "failed"],
)
def test_the_check_passes_only_when_a_cuda_test_ran(
    tmp_path: Path, fake: dict[str, Any], said: str | None, status: int, tests_said: str
) -> None:
    """A passing pytest run counts only when at least one CUDA test ran (by the junit
    summary): all skipped, none collected or no summary is "no CUDA test ran" and exit 1,
    and the benchmark runs either way."""
    fakes = _fakes(tmp_path, **fake)

    output, log, returncode = _run_fakes(tmp_path, fakes)

    assert returncode == status, output
    ran = [line for line in log.splitlines() if line.startswith("gpu_check: no CUDA test ran")]
    assert ran == ([] if said is None else [ran[0]]), log
    if said is not None:
        assert said in ran[0]
    last = output.rstrip().splitlines()[-1]
    assert last.startswith(f"gpu_check: CUDA tests: {tests_said}; bench: passed;"), last
    # The summary ran on the fake's files: an empty JSON has no figures.
    assert re.search(r"^D2H store / H2D retrieve +not run$", log, re.M), log
    assert (tmp_path / "out" / "gpu_bench.json").read_text() == "{}"
