"""``vllm serve`` as a child process: vLLM's OpenAI server on a local model directory, with
the lmcache_async connector (or none) and vLLM's KV event stream.

:class:`VllmServer` starts ``python -m vllm.entrypoints.openai.api_server`` on a free
loopback port with prompts as token ids (``--skip-tokenizer-init``), ``--enforce-eager``,
vLLM's prefix cache on, a KV cache of ``num_blocks`` blocks of ``block_size`` tokens, and
``--kv-events-config`` publishing on ``tcp://*:<events_port>`` (vLLM binds wildcard
addresses and connects to others). Its log goes to a file, quoted when it fails; it ends by
pid (SIGTERM, then SIGKILL). :meth:`VllmServer.first_token` streams one completion and
returns its time to first token with the prompt tokens vLLM did not compute
(``usage.prompt_tokens_details.cached_tokens``: its own prefix cache's hits plus the
connector's; ``--enable-prompt-tokens-details`` is on and the stream asks for its usage).
The connector's own per-request counts (``request_stats``) ride on ``kv_transfer_params``,
which vLLM's completions API returns only when not streaming.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final, NamedTuple

from .ports import free_port, live_pid, log_tail

__all__ = [
    "START_TIMEOUT",
    "FirstToken",
    "PrefixHits",
    "ServerError",
    "VllmServer",
    "connector_config",
]

START_TIMEOUT: Final = 240.0
"""Seconds a server gets to answer ``GET /health`` (it takes 20-40 s on two cores)."""
STOP_TIMEOUT: Final = 20.0
"""Seconds a server gets to exit after SIGTERM before it is killed."""
REQUEST_TIMEOUT: Final = 300.0
"""Seconds one completion may take."""
METRICS_TIMEOUT: Final = 10.0
"""Seconds reading the server's metrics may take."""
_LOCAL_HITS: Final = "vllm:prefix_cache_hits_total"
_EXTERNAL_HITS: Final = "vllm:external_prefix_cache_hits_total"
_START_ATTEMPTS: Final = 3


class ServerError(RuntimeError):
    """The server could not start, exited, or refused a request (the message quotes its
    log)."""


class FirstToken(NamedTuple):
    """One streamed completion: its time to first token and its prompt's cached part."""

    seconds: float
    """From sending the request to its first streamed token."""
    prompt_tokens: int
    cached_tokens: int
    """Prompt tokens vLLM did not compute: hits in its prefix cache plus the connector's."""
    token_ids: tuple[int, ...] = ()
    """The generated tokens, when asked for (``first_token(..., token_ids=True)``)."""


class PrefixHits(NamedTuple):
    """Prompt tokens a server did not compute since it started, by where they were found
    (its Prometheus counters ``vllm:prefix_cache_hits`` and
    ``vllm:external_prefix_cache_hits``)."""

    local: int
    """Found in vLLM's own KV cache (its prefix cache)."""
    external: int
    """Found by the connector (our cache)."""


def connector_config(extra: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for the lmcache_async connector with ``extra`` as its
    ``kv_connector_extra_config`` (a failed load is recomputed)."""
    return {
        "kv_connector": "LMCacheAsyncConnector",
        "kv_connector_module_path": "lmcache_async.integrations.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": dict(extra),
    }


class VllmServer:
    """One ``vllm serve`` on ``model_dir`` (served as ``model_name``), started by
    :meth:`start`; a context manager that stops it on exit.

    ``kv_transfer``: vLLM's ``--kv-transfer-config`` (:func:`connector_config`), or None
    for no connector. ``num_blocks``: vLLM's KV cache, in blocks of ``block_size`` tokens
    (``--num-gpu-blocks-override``). ``extra_args``: more ``vllm serve`` flags, appended
    (``--no-enable-prefix-caching``).
    """

    def __init__(
        self,
        model_dir: str,
        log_path: Path,
        *,
        model_name: str = "model",
        block_size: int = 32,
        num_blocks: int = 64,
        max_model_len: int = 1024,
        kv_transfer: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.model_dir = model_dir
        self.log_path = log_path
        self.model_name = model_name
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.kv_transfer = None if kv_transfer is None else dict(kv_transfer)
        self.env = dict(env or {})
        self.extra_args = tuple(extra_args)
        self.port = 0
        self.events_port = 0
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def events_endpoint(self) -> str:
        """Where a subscriber (a router's indexer) connects for the KV events."""
        return f"tcp://127.0.0.1:{self.events_port}"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def pid(self) -> int | None:
        """The process's id while it runs (its children are its own)."""
        return live_pid(self._process)

    def log_tail(self, size: int = 6000) -> str:
        return log_tail(self.log_path, size)

    def _command(self) -> list[str]:
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.events_port}",
        }
        command = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model_dir,
            "--served-model-name",
            self.model_name,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--skip-tokenizer-init",
            "--enforce-eager",
            "--block-size",
            str(self.block_size),
            "--max-model-len",
            str(self.max_model_len),
            "--num-gpu-blocks-override",
            str(self.num_blocks),
            "--kv-events-config",
            json.dumps(events),
            "--enable-prompt-tokens-details",
        ]
        if self.kv_transfer is not None:
            command += ["--kv-transfer-config", json.dumps(self.kv_transfer)]
        return [*command, *self.extra_args]

    def start(self) -> VllmServer:
        """Start on fresh free ports and wait, bounded by :data:`START_TIMEOUT`, until the
        server answers ``GET /health``.

        Raises:
            ServerError: it exited or never answered (the message holds its log's end).
        """
        last = ""
        for _ in range(_START_ATTEMPTS):
            self.port, self.events_port = free_port(), free_port()
            try:
                self._launch()
                return self
            except ServerError as exc:
                last = str(exc)
                if "address already in use" not in last.lower():
                    raise
        raise ServerError(f"vllm serve did not start after {_START_ATTEMPTS} tries: {last}")

    def _launch(self) -> None:
        import httpx  # noqa: PLC0415  (vLLM's dependency)

        environment = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **self.env}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                self._command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=environment,
                start_new_session=True,
            )
        deadline = time.monotonic() + START_TIMEOUT
        with httpx.Client(base_url=self.url, timeout=2.0, trust_env=False) as client:
            while time.monotonic() < deadline:
                if self._process.poll() is not None:
                    code = self._process.returncode
                    self._process = None
                    raise ServerError(f"vllm serve exited with {code}: {self.log_tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get("/health").status_code == 200:
                        return
                time.sleep(0.2)
        self.stop()
        raise ServerError(f"vllm serve did not answer within {START_TIMEOUT} s: {self.log_tail()}")

    def stop(self) -> None:
        """End the server and its children (its process group): SIGTERM, then SIGKILL."""
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=STOP_TIMEOUT)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # children left behind

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def first_token(
        self, tokens: Sequence[int], *, max_tokens: int = 1, token_ids: bool = False
    ) -> FirstToken:
        """Send one completion of ``tokens`` (streamed) and return the seconds until its
        first token arrived and its usage; the rest is read to the end. ``token_ids``: also
        return the generated tokens (vLLM's ``return_token_ids``).

        Raises:
            ServerError: not running, an error status or streamed error, no token or no
                usage streamed.
            httpx.HTTPError: no answer within :data:`REQUEST_TIMEOUT`.
        """
        import httpx  # noqa: PLC0415

        if not self.running:
            raise ServerError(f"vllm serve is not running: {self.log_tail()}")
        body = {
            "model": self.model_name,
            "prompt": list(tokens),
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if token_ids:
            body["return_token_ids"] = True
        generated: list[int] = []
        first: float | None = None
        usage: dict[str, Any] | None = None
        async with httpx.AsyncClient(
            base_url=self.url, timeout=REQUEST_TIMEOUT, trust_env=False
        ) as client:
            began = time.perf_counter()
            async with client.stream("POST", "/v1/completions", json=body) as response:
                if response.is_error:
                    await response.aread()
                    raise ServerError(f"completion -> {response.status_code}: {response.text}")
                async for line in response.aiter_lines():
                    if not line.startswith("data:") or "[DONE]" in line:
                        continue
                    chunk = json.loads(line.removeprefix("data:"))
                    if "error" in chunk:  # a failure after the stream began
                        raise ServerError(f"the completion failed: {chunk['error']}")
                    if first is None and chunk.get("choices"):
                        first = time.perf_counter() - began
                    for choice in chunk.get("choices") or ():
                        generated += choice.get("token_ids") or ()
                    usage = chunk.get("usage") or usage
        if first is None:
            raise ServerError("the completion streamed no token")
        if usage is None:
            raise ServerError("the completion streamed no usage")
        details = usage.get("prompt_tokens_details") or {}
        return FirstToken(
            first,
            int(usage["prompt_tokens"]),
            int(details.get("cached_tokens") or 0),
            tuple(generated),
        )

    async def prefix_hits(self) -> PrefixHits:
        """vLLM's prefix-cache hit counters, read from ``GET /metrics``.

        Raises:
            ServerError: not running, or an error status.
            httpx.HTTPError: no answer within :data:`METRICS_TIMEOUT`.
        """
        import httpx  # noqa: PLC0415

        if not self.running:
            raise ServerError(f"vllm serve is not running: {self.log_tail()}")
        async with httpx.AsyncClient(
            base_url=self.url, timeout=METRICS_TIMEOUT, trust_env=False
        ) as client:
            response = await client.get("/metrics")
        if response.is_error:
            raise ServerError(f"/metrics -> {response.status_code}: {response.text}")
        totals = {_LOCAL_HITS: 0.0, _EXTERNAL_HITS: 0.0}
        for line in response.text.splitlines():
            name, _, rest = line.partition("{")
            if name in totals:
                totals[name] += float(rest.rpartition(" ")[2])
        return PrefixHits(int(totals[_LOCAL_HITS]), int(totals[_EXTERNAL_HITS]))
