"""A stand-in for the python of scripts/gpu_check.sh, for running the script end to end on a
machine without a GPU in well under a second.

Run as ``python fake_gpu_python.py CONFIG ARGS...``: it appends ``{"env": [...], "args":
ARGS}`` to the JSON-lines file ``CONFIG["calls"]`` (the env being PYTHONUNBUFFERED and
PYTHONFAULTHANDLER as it saw them), then answers the call the script made as ``CONFIG``
says: whether its torch is a CUDA build, whether pip is there, whether the device probe
finds a device, the junit summary its pytest writes (``tests`` of which ``skipped``, or
none when ``junit`` is false) and the exit statuses of its pytest and benchmark. The
script's own count of the tests that ran (its ``xml.etree`` code) and its summary
(scripts/gpu_summary.py) are run for real. A call it does not know exits with status 99 and
names it.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path
from typing import Any, NoReturn

JUNIT = (
    '<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests">'
    '<testsuite name="pytest" errors="0" failures="0" skipped="{skipped}" tests="{tests}" />'
    "</testsuites>"
)


def done(status: int = 0, text: str | None = None) -> NoReturn:
    if text is not None:
        print(text)
    sys.exit(status)


def answer(config: dict[str, Any], rest: list[str]) -> NoReturn:
    """Answer one call of the script, ``rest`` being its arguments after the flags."""
    if rest[:1] == ["-c"]:
        code = rest[1]
        if "is_available" in code:  # the device probe
            if config["device"]:
                done(0, "torch 0, CUDA build fake, device Fake GPU")
            done(1, "torch 0, CUDA build None, device none")
        if "torch.version.cuda" in code:  # pick_python: a CUDA build?
            done(0 if config["cuda_build"] else 1)
        if code == "import torch" or "zipfile" in code:  # pick_python; unpacking wheels
            done()
        if "sys.version" in code:
            done(0, "3.12.0")
        if "xml.etree" in code:
            sys.argv = ["-c", *rest[2:]]
            exec(code)
            done()
    if rest[:2] == ["-m", "pip"]:
        done(0 if rest[2:] != ["--version"] or config["pip"] else 1)
    if rest == ["-"]:  # the version and import checks, on stdin
        sys.stdin.read()
        done(0, "imports ok: torch, lmcache_async")
    if rest[:2] == ["-m", "pytest"]:
        tests, skipped = config["tests"], config["skipped"]
        if config["junit"]:
            junit = next(a.split("=", 1)[1] for a in rest if a.startswith("--junitxml="))
            Path(junit).write_text(JUNIT.format(tests=tests, skipped=skipped))
        done(config["pytest_exit"], f"fake pytest: {tests - skipped} passed, {skipped} skipped")
    if rest[:1] == ["scripts/gpu_summary.py"]:
        sys.argv = rest
        runpy.run_path(rest[0], run_name="__main__")
        done()
    if rest[:2] == ["-m", "lmcache_async.cli"]:
        Path(rest[rest.index("--json") + 1]).write_text("{}")
        done(config["bench_exit"])
    done(99, f"fake python: unexpected call {rest!r}")


def main() -> NoReturn:
    config = json.loads(Path(sys.argv[1]).read_text())
    args = sys.argv[2:]
    env = [os.environ.get("PYTHONUNBUFFERED"), os.environ.get("PYTHONFAULTHANDLER")]
    with open(config["calls"], "a") as calls:
        calls.write(json.dumps({"env": env, "args": args}) + "\n")
    rest = list(args)
    while rest[:1] in (["-u"], ["-X"]):
        rest = rest[2:] if rest[0] == "-X" else rest[1:]
    answer(config, rest)


if __name__ == "__main__":
    main()
