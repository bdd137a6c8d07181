"""NVIDIA Dynamo's standalone KV indexer (``python -m dynamo.indexer``) as a child process,
for the routing benchmark and the tests.

The indexer is the index of a KV-aware router: it subscribes to workers' ZMQ KV event
streams (vLLM's wire format: ``[topic, 8-byte big-endian seq, msgpack KVEventBatch]``) and
answers overlap queries over HTTP. Events we publish are understood by real routers when
this index matches our prompts.

:class:`DynamoIndexer` runs one indexer as a child process on a free loopback port, its log
kept in a file for failure messages, and ends it by pid (SIGTERM, then SIGKILL). Its HTTP
calls (``POST /query``, ``GET /dump``, ``POST /register``) are async with a timeout.

What the indexer does with events (ai-dynamo-runtime 1.6.1):

- The ``medium`` of an event picks a tier: ``"GPU"`` or none -> ``device``, ``"CPU"`` or
  ``"CPU_PINNED"`` -> ``host_pinned``, ``"DISK"`` or ``"STORAGE"`` -> ``disk``. ``/query``
  counts are cumulative: ``cpu`` counts tokens matched on GPU or CPU, ``disk`` on any tier.
  A ``BlockRemoved`` only removes from the tier its own ``medium`` names.
- ``/query`` hashes the query's tokens per block and walks the tree; a stored block is
  placed by ``parent_block_hash`` (which must name a block already indexed, or the store is
  dropped) and found by its own ``token_ids``. ``block_hashes`` are opaque ids, used for
  parents and removals only.
- An event's ``block_size`` must equal ``--block-size``: other blocks are dropped.
- Batches are ordered by seq per worker: a seq at or below the last one is dropped as
  stale; a gap is asked for on a ROUTER replay endpoint when one was registered.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final, NamedTuple

import httpx

from .ports import free_port, log_tail

__all__ = [
    "DynamoIndexer",
    "IndexedBlock",
    "IndexerError",
    "TierMatch",
]

START_TIMEOUT: Final = 30.0
"""Seconds the indexer gets to answer ``GET /health`` after it is started (it takes ~0.3 s)."""

STOP_TIMEOUT: Final = 5.0
"""Seconds the indexer gets to exit after SIGTERM before it is killed."""

REQUEST_TIMEOUT: Final = 10.0
"""Seconds one HTTP call to the indexer may take."""

_START_ATTEMPTS: Final = 5


class IndexerError(RuntimeError):
    """The indexer could not be started, did not become ready, or refused a request."""


class TierMatch(NamedTuple):
    """One worker's match for a query, in tokens: ``cpu`` and ``disk`` are cumulative
    (``cpu`` counts tokens matched on GPU or CPU, ``disk`` on any tier)."""

    longest_matched: int = 0
    gpu: int = 0
    cpu: int = 0
    disk: int = 0


class IndexedBlock(NamedTuple):
    """One block as ``GET /dump`` lists it."""

    worker_id: int
    storage_tier: str
    """``"device"``, ``"host_pinned"`` or ``"disk"``."""
    block_hash: int
    parent_hash: int | None


class DynamoIndexer:
    """One ``python -m dynamo.indexer`` on a free port, started by :meth:`start`.

    ``workers`` maps a worker id to the ZMQ endpoint of its event publisher (registered at
    startup under ``model_name`` with ``block_size``); more can be added with
    :meth:`register`. Usable as a context manager that stops the indexer on exit.

    Raises:
        ValueError: ``block_size`` or ``threads`` is not positive.
    """

    def __init__(
        self,
        directory: Path,
        *,
        block_size: int,
        model_name: str,
        workers: Mapping[int, str],
        threads: int = 1,
        python: str = sys.executable,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if threads <= 0:
            raise ValueError(f"threads must be positive, got {threads}")
        self.directory = directory
        self.block_size = block_size
        self.model_name = model_name
        self.workers = dict(workers)
        self.threads = threads
        self.python = python
        self.port = 0
        self._process: subprocess.Popen[bytes] | None = None
        directory.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>``."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        """The indexer's stdout and stderr (JSON lines)."""
        return self.directory / "indexer.log"

    @property
    def pid(self) -> int | None:
        """The indexer's pid while it runs."""
        return None if self._process is None else self._process.pid

    @property
    def running(self) -> bool:
        """Whether the indexer process is alive."""
        return self._process is not None and self._process.poll() is None

    def log_tail(self, size: int = 4000) -> str:
        """The last ``size`` characters of the indexer's log (for failure messages)."""
        return log_tail(self.log_path, size)

    def _command(self) -> list[str]:
        args = [
            self.python,
            "-m",
            "dynamo.indexer",
            "--port",
            str(self.port),
            "--block-size",
            str(self.block_size),
            "--model-name",
            self.model_name,
            "--threads",
            str(self.threads),
        ]
        if self.workers:
            args += ["--workers", ",".join(f"{w}={ep}" for w, ep in self.workers.items())]
        return args

    def _environment(self) -> dict[str, str]:
        env = dict(os.environ)
        # Plain JSON lines instead of ANSI-coloured text in the log file.
        env["DYN_LOGGING_JSONL"] = "1"
        # Set, it holds the HTTP listener back until that many workers registered.
        env.pop("DYN_ROUTER_MIN_INITIAL_WORKERS", None)
        return env

    def start(self) -> DynamoIndexer:
        """Start on a fresh free port (retrying if another process takes it first) and wait,
        bounded by :data:`START_TIMEOUT`, until ``GET /health`` answers.

        Raises:
            IndexerError: already running, or it exited or never answered (the message
                holds the end of its log).
        """
        if self.running:
            raise IndexerError(f"indexer already running on port {self.port}")
        last = ""
        for _ in range(_START_ATTEMPTS):
            self.port = free_port()
            try:
                self._launch()
            except IndexerError as exc:
                last = str(exc)
                if "in use" not in last.lower():
                    raise
                continue
            return self
        raise IndexerError(f"indexer did not start after {_START_ATTEMPTS} tries: {last}")

    def _launch(self) -> None:
        with self.log_path.open("ab") as log:
            process = subprocess.Popen(
                self._command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.directory,
                env=self._environment(),
            )
        self._process = process
        deadline = time.monotonic() + START_TIMEOUT
        with httpx.Client(base_url=self.url, timeout=1.0, trust_env=False) as client:
            while time.monotonic() < deadline:
                if process.poll() is not None:
                    self._process = None
                    raise IndexerError(
                        f"indexer on port {self.port} exited with {process.returncode}: "
                        + self.log_tail()
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if client.get("/health").status_code == 200:
                        return
                time.sleep(0.02)
        self.stop()
        raise IndexerError(
            f"indexer on port {self.port} did not answer /health within {START_TIMEOUT} s: "
            + self.log_tail()
        )

    def stop(self) -> None:
        """End the indexer by pid: SIGTERM, then SIGKILL if it has not exited in time."""
        process = self._process
        if process is None:
            return
        self._process = None
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGKILL)
                process.wait(timeout=STOP_TIMEOUT)

    def __enter__(self) -> DynamoIndexer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def _request(self, method: str, path: str, body: Any = None) -> Any:
        if not self.running:
            raise IndexerError(f"indexer is not running: {self.log_tail()}")
        async with httpx.AsyncClient(
            base_url=self.url, timeout=REQUEST_TIMEOUT, trust_env=False
        ) as client:
            response = await client.request(method, path, json=body)
        if response.is_error:
            raise IndexerError(f"{method} {path} -> {response.status_code}: {response.text}")
        return response.json()

    async def query(self, token_ids: Sequence[int], *, model_name: str | None = None) -> Any:
        """``POST /query``: ``{"scores": ..., "frequencies": ..., "instances": {worker:
        {"longest_matched", "gpu", "dp", "cpu", "disk"}}}``, counts in tokens.

        Raises:
            IndexerError: not running, or an error status (404 for an unknown model).
            httpx.HTTPError: no answer within :data:`REQUEST_TIMEOUT`.
        """
        body = {"token_ids": list(token_ids), "model_name": model_name or self.model_name}
        return await self._request("POST", "/query", body)

    async def match(
        self, token_ids: Sequence[int], worker_id: int, *, model_name: str | None = None
    ) -> TierMatch:
        """The match of ``token_ids`` on one worker (all zeros when it matches nothing).

        Raises:
            IndexerError: as :meth:`query`.
        """
        answer = await self.query(token_ids, model_name=model_name)
        found = answer["instances"].get(str(worker_id))
        if found is None:
            return TierMatch()
        return TierMatch(found["longest_matched"], found["gpu"], found["cpu"], found["disk"])

    async def dump(self) -> Any:
        """``GET /dump``: ``{"<model>:<routing group>": {"block_size", "events": [...]}}``,
        the index rebuilt as store events, each with its ``worker_id`` and ``storage_tier``.

        Raises:
            IndexerError: not running, or an error status.
            httpx.HTTPError: no answer within :data:`REQUEST_TIMEOUT`.
        """
        return await self._request("GET", "/dump")

    async def indexed_blocks(self, *, model_name: str | None = None) -> list[IndexedBlock]:
        """The blocks ``GET /dump`` lists for one model (the default routing group).

        Raises:
            IndexerError: as :meth:`dump`.
        """
        entry = (await self.dump()).get(f"{model_name or self.model_name}:default", {})
        blocks = []
        for item in entry.get("events", []):
            stored = item["event"]["data"].get("stored")
            if stored is None:
                continue
            parent = stored["parent_hash"]
            for block in stored["blocks"]:
                blocks.append(
                    IndexedBlock(
                        item["worker_id"], item["storage_tier"], block["block_hash"], parent
                    )
                )
                parent = block["block_hash"]
        return blocks

    async def register(
        self,
        worker_id: int,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        model_name: str | None = None,
        block_size: int | None = None,
    ) -> None:
        """``POST /register``: subscribe to one more worker, with a ROUTER ``replay_endpoint``
        the indexer asks for missed batches (the only way to give it one).

        Raises:
            IndexerError: not running, or refused (e.g. a block size other than the model's).
        """
        body: dict[str, Any] = {
            "instance_id": worker_id,
            "endpoint": endpoint,
            "model_name": model_name or self.model_name,
            "block_size": block_size or self.block_size,
        }
        if replay_endpoint is not None:
            body["replay_endpoint"] = replay_endpoint
        await self._request("POST", "/register", body)
