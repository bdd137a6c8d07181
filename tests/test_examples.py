"""Every script in examples/ runs, small, in its own process, and says what it should.

A new example needs an entry in ``EXAMPLES`` (its small arguments and the lines its output
must hold); the first test fails until it has one.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"
TIMEOUT = 120.0


@dataclass(frozen=True)
class Example:
    args: tuple[str, ...]
    expect: tuple[str, ...]
    """Regular expressions, each matching a line of the output."""
    needs: tuple[str, ...] = ()
    """Modules the script imports beyond the package's dependencies."""


EXAMPLES: dict[str, Example] = {
    "transformers_prefix_reuse.py": Example(
        args=(
            *("--layers", "2", "--hidden", "128", "--heads", "4", "--kv-heads", "2"),
            *("--intermediate", "256", "--vocab", "512", "--prefix", "200", "--suffix", "16"),
            *("--chunk-size", "64", "--repeats", "2", "--threads", "1"),
        ),
        expect=(
            r"^stored request 0: 216 tokens, 216 cached \(chunk 64\)$",
            r"^request 1: reused 192 of 216 tokens, logits identical$",
            r"^request 2: reused 192 of 216 tokens, logits identical$",
            r"^TTFT without cache: \d+\.\d ms \(median of 2\)$",
            r"^TTFT with cache: +\d+\.\d ms \(median of 2\)$",
            r"^logits match: yes \(bit-exact\)$",
        ),
        needs=("transformers",),
    ),
}


def test_every_example_has_an_entry() -> None:
    scripts = sorted(path.name for path in EXAMPLES_DIR.glob("*.py"))
    assert scripts, f"no examples in {EXAMPLES_DIR}"
    missing = [name for name in scripts if name not in EXAMPLES]
    assert not missing, f"add small arguments and expected output to EXAMPLES for {missing}"
    stale = [name for name in EXAMPLES if name not in scripts]
    assert not stale, f"EXAMPLES names scripts that are gone: {stale}"


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_runs(name: str) -> None:
    example = EXAMPLES[name]
    for module in example.needs:
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{name} needs {module}")
    done = subprocess.run(
        [sys.executable, str(EXAMPLES_DIR / name), *example.args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    # The library says nothing unasked: an example's stderr stays empty.
    assert done.stderr == ""
    lines = done.stdout.splitlines()
    for pattern in example.expect:
        assert any(re.search(pattern, line) for line in lines), (
            f"no line matches {pattern!r} in:\n{done.stdout}"
        )
