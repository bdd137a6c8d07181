"""The harness of test_vllm_failures.py: a tier broken between the connector's promise and
the worker's load, in a vLLM runner.

As a script, this module runs vllm_steps.py's runner (its flags follow) with one more
fault, ``--on-alloc ACTION DIR RECORD``: the first time the connector's
``update_state_after_alloc`` is given external tokens (the promise settled, the worker's
load not yet started) it does ``ACTION`` (:data:`ACTIONS`) to the disk tier in ``DIR`` and
writes ``RECORD`` (JSON): the request, its external tokens, the chunk files there before
and after. :class:`FailingSteps` starts it; :class:`Failures` holds what the tests share.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any, Final

from tests.integrations.vllm_hits import CHUNK, SHORT, Hits, request
from tests.integrations.vllm_steps import StepsProcess

__all__ = ["ACTIONS", "FailingSteps", "Failures"]

ACTIONS: Final = ("delete", "clear")
"""``--on-alloc`` actions: ``delete`` the chunk files under ``DIR`` (behind the engine's
back, as a disk lost); ``clear`` the worker's cache engine (``SyncCacheEngine.clear``:
every tier, the promise's pins too)."""


class FailingSteps(StepsProcess):
    """vllm_steps.py's runner started through this module, so that ``args`` may begin
    with ``--on-alloc ACTION DIR RECORD``."""

    script = Path(__file__).resolve()


class Failures:
    """The model, the reference process (vLLM with the do-nothing connector) and Redis of
    :class:`~tests.integrations.vllm_hits.Hits`; one prompt, its reference output, and its
    chunks on disk as stored by a process that stores whole chunks and by a layerwise one
    (one entry per chunk and layer)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.hits = Hits(root)
        self.prompt = self.hits.prompt(SHORT)
        (self.expected,) = self.hits.expected([self.prompt])
        self._processes: list[FailingSteps] = []
        self._stored = {layerwise: self._store(layerwise) for layerwise in (False, True)}

    def _store(self, layerwise: bool) -> Path:
        disk = self.root / f"stored-{'layerwise' if layerwise else 'chunks'}"
        extra: dict[str, Any] = {"local_disk": str(disk), "wait_for_slow_tiers": True}
        if layerwise:
            extra["use_layerwise"] = True
        process = self.hits.process(disk.name, extra, warm_up=False)
        (result,) = process.generate([request("store", self.prompt)])["results"]
        assert result["connector"]["stored_tokens"] == SHORT, result["connector"]
        self.hits.close(process)
        return disk

    def disk(self, name: str, *, layerwise: bool = False) -> Path:
        """A fresh copy of the stored disk tier (of the layerwise process with
        ``layerwise``) for process ``name``."""
        disk = self.root / f"disk-{name}"
        shutil.copytree(self._stored[layerwise], disk)
        return disk

    def process(
        self,
        name: str,
        extra: dict[str, Any],
        *flags: str,
        on_alloc: tuple[str, Path] | None = None,
    ) -> FailingSteps:
        """Start a runner with the connector config ``extra`` and the runner's ``flags``;
        ``on_alloc``: (action, disk directory) of ``--on-alloc``, recorded in
        :meth:`record` (``name``)."""
        args: list[str] = []
        if on_alloc is not None:
            action, disk = on_alloc
            args += ["--on-alloc", action, str(disk), str(self._record_path(name))]
        args += ["--model", str(self.hits.model), "--max-batched-tokens", str(CHUNK), *flags]
        args += ["--connector-config", json.dumps(self.hits.config(name, **extra))]
        process = FailingSteps(args, self.root / f"{name}.log")
        self._processes.append(process)
        process.start()
        return process

    def _record_path(self, name: str) -> Path:
        return self.root / f"{name}.on-alloc.json"

    def record(self, name: str) -> dict[str, Any]:
        """What ``--on-alloc`` of process ``name`` recorded (an AssertionError when it
        never fired: no request was given external tokens)."""
        path = self._record_path(name)
        assert path.exists(), f"{name}: no request was given external tokens"
        record: dict[str, Any] = json.loads(path.read_text())
        return record

    def close(self, process: StepsProcess) -> None:
        self.hits.close(process)

    def shutdown(self) -> None:
        for process in self._processes:
            process.close()
        self.hits.shutdown()


# -- the runner ------------------------------------------------------------------------------


def _on_alloc(action: str, directory: Path, record: Path) -> None:
    """Wrap the connector's ``update_state_after_alloc`` to do ``action`` the first time a
    request is given external tokens, and write ``record``."""
    from lmcache_async.integrations.vllm import LMCacheAsyncConnector, connector

    engines: list[Any] = []  # the worker's cache engine, once opened
    opened = connector.open_engine

    def open_engine(*args: Any, **kwargs: Any) -> Any:
        engine = opened(*args, **kwargs)
        engines.append(engine)
        return engine

    connector.open_engine = open_engine  # type: ignore[assignment]
    original = LMCacheAsyncConnector.update_state_after_alloc
    fired: list[bool] = []

    def chunk_files() -> list[str]:
        return sorted(path.name for path in directory.rglob("*.chunk"))

    def update_state_after_alloc(
        self: Any, request: Any, blocks: Any, num_external_tokens: int
    ) -> None:
        if num_external_tokens > 0 and not fired:
            fired.append(True)
            done: dict[str, Any] = {
                "request": request.request_id,
                "external_tokens": num_external_tokens,
                "files": chunk_files(),
            }
            if action == "delete":
                for path in directory.rglob("*.chunk"):
                    path.unlink()
            else:
                (engine,) = engines
                done["cleared_chunks"] = engine.clear()
            done["files_left"] = chunk_files()
            record.write_text(json.dumps(done))
        original(self, request, blocks, num_external_tokens)

    LMCacheAsyncConnector.update_state_after_alloc = update_state_after_alloc  # type: ignore[method-assign]


def main(argv: list[str]) -> int:
    from tests.integrations import vllm_steps

    if argv[:1] == ["--on-alloc"]:
        action, directory, record = argv[1:4]
        if action not in ACTIONS:
            raise SystemExit(f"--on-alloc takes one of {ACTIONS}, got {action!r}")
        _on_alloc(action, Path(directory), Path(record))
        argv = argv[4:]
    return vllm_steps.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
