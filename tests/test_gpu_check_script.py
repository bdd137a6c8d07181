"""scripts/gpu_check.sh on a machine without a GPU: it checks the imports first, then stops
with a clear "no CUDA device" and its own exit status, and logs what it printed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh"

pytestmark = [
    pytest.mark.skipif(
        torch.cuda.is_available(), reason="with a GPU the script runs the whole check"
    ),
]


def _run(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess[str], str]:
    """Run the script with a CPU python, no wheels and its output under ``tmp_path``."""
    out = tmp_path / "out"
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
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    log = (out / "gpu_check.log").read_text()
    return proc, log


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
