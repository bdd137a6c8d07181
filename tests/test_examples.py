"""Every script in examples/ runs, small, in its own process, and says what it should.

A new example (``*.py`` or ``*.sh``) needs an entry in ``EXAMPLES`` (its small arguments and
the lines its output must hold); the first test fails until it has one. Shell scripts run
under bash with this interpreter's directory first on ``PATH`` (``python``,
``lmcache-async``).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"
TIMEOUT = 120.0


@dataclass(frozen=True)
class Example:
    args: tuple[str, ...] = ()
    expect: tuple[str, ...] = ()
    """Regular expressions, each matching a line of the output."""
    needs: tuple[str, ...] = ()
    """Modules the script imports beyond the package's dependencies."""
    commands: tuple[str, ...] = ()
    """Programs the script runs beyond Python (looked up on ``PATH``)."""
    run_by: str | None = None
    """The example that starts this one and checks it (a server run by its client): this
    one has no run of its own."""


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
    "async_server.py": Example(run_by="async_server_client.py"),
    "async_server_client.py": Example(
        args=(
            *("--prefix", "256", "--concurrency", "3"),
            # Flags for the server it starts: a smaller model, one torch thread.
            *("--layers", "2", "--hidden", "128", "--vocab", "512", "--chunk-size", "64"),
            *("--threads", "1"),
        ),
        expect=(
            r"^server: http://127\.0\.0\.1:\d+$",
            r"^first request: 272 prompt tokens, 0 from the cache$",
            r"^3 concurrent requests: \[256, 256, 256\] prompt tokens from the cache$",
            r"^tokens generated with the cache equal to those without: 3 of 3$",
            r"^client left mid-stream: 1 request cancelled, 0 chunks pinned, 0 lookups open$",
            r"^server: engine closed$",
        ),
        needs=("fastapi", "uvicorn", "httpx", "transformers"),
    ),
    "shared_sidecar.py": Example(
        args=("--tokens", "256"),
        expect=(
            r"^sidecar: ipc://\S+$",
            r"^A stored 256 tokens, B loaded 256, bytes equal: True$",
            r"^sidecar restarted: B loaded 0 tokens \(a miss\)$",
            r"^A stored 256 again, B loaded 256, bytes equal: True$",
            r"^all processes stopped$",
        ),
    ),
    "load_test.py": Example(
        args=(
            *("--requests", "60", "--rate", "50", "--prefixes", "2"),
            *("--prefix", "256", "--suffix", "32"),
        ),
        expect=(
            r"^workload: 60 requests at 50/s, 70% on 2 shared 256-token prefixes, 32 new",
            r"^done: 60 of 60 requests in \d+\.\d s, 0 failed$",
            # Some requests hit (the first of each prefix cannot), and every load was exact.
            r"^hit rate: \d+\.\d% of prompt tokens; ([1-9]\d*) requests hit, \1 of their loads",
            r"^lookup \+ load: p50 \d+\.\d\d ms, p90 \d+\.\d\d ms, p99 \d+\.\d\d ms$",
            r"^store: p50 \d+\.\d\d ms, p90 \d+\.\d\d ms, p99 \d+\.\d\d ms$",
        ),
    ),
    # The whole fleet (two vLLM servers) takes minutes: the dry run checks the flags with
    # vLLM's parser and starts the sidecar and the indexer with the commands it prints.
    "vllm_fleet.sh": Example(
        args=("--dry-run",),
        expect=(
            r"^  \$ python -m vllm\.entrypoints\.openai\.api_server --model MODEL_DIR .*"
            r"--kv-transfer-config '\{.*\"sidecar_url\": \"ipc://\S+\".*--kv-events-config '",
            r"^vLLM and the connector accept both servers' flags$",
            r"^  \$ lmcache-async --log-level WARNING serve --listen ipc://\S+ .*--events tcp://",
            r"^sidecar: healthy$",
            r"^  \$ python -m dynamo\.indexer --port \d+ --block-size 32 --model-name tiny "
            r"--workers 1=tcp://127\.0\.0\.1:\d+,2=tcp://127\.0\.0\.1:\d+$",
            r"^indexer: answers on http://127\.0\.0\.1:\d+$",
        ),
        needs=("vllm", "dynamo.indexer"),
        commands=("bash", "curl", "setsid"),
    ),
}


def test_every_example_has_an_entry() -> None:
    scripts = sorted(
        path.name for pattern in ("*.py", "*.sh") for path in EXAMPLES_DIR.glob(pattern)
    )
    assert scripts, f"no examples in {EXAMPLES_DIR}"
    missing = [name for name in scripts if name not in EXAMPLES]
    assert not missing, f"add small arguments and expected output to EXAMPLES for {missing}"
    stale = [name for name in EXAMPLES if name not in scripts]
    assert not stale, f"EXAMPLES names scripts that are gone: {stale}"
    for name, example in EXAMPLES.items():
        runner = example.run_by
        assert example.expect or runner is not None, f"{name}: no expected output"
        if runner is not None:
            assert runner in EXAMPLES and EXAMPLES[runner].run_by is None, f"{name}: {runner}"


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(n for n, e in EXAMPLES.items() if e.run_by is None))
def test_example_runs(name: str) -> None:
    example = EXAMPLES[name]
    for module in example.needs:
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{name} needs {module}")
    for program in example.commands:
        if shutil.which(program) is None:
            pytest.skip(f"{name} needs {program}")
    script = str(EXAMPLES_DIR / name)
    command = ["bash", script] if name.endswith(".sh") else [sys.executable, script]
    bin_dir = str(Path(sys.executable).parent)
    done = subprocess.run(
        [*command, *example.args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
        env={**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")},
    )
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    # The library says nothing unasked: an example's stderr stays empty.
    assert done.stderr == ""
    lines = done.stdout.splitlines()
    for pattern in example.expect:
        assert any(re.search(pattern, line) for line in lines), (
            f"no line matches {pattern!r} in:\n{done.stdout}"
        )
