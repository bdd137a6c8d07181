"""The harness of test_vllm_hits.py: the model, the prompts, a Redis server, the reference
process (the do-nothing connector) and the storing run, and the helpers that compare
outputs and wait for quiet."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integrations.test_vllm import (
    LOGPROB_TOLERANCE,
    _run,
    assert_same_result,
)
from tests.integrations.vllm_steps import StepsProcess
from tests.servers import RedisServer

__all__ = [
    "BLOCK",
    "CHUNK",
    "KV_BYTES_PER_TOKEN",
    "LONG",
    "MODEL_MODULE",
    "REPS",
    "SHORT",
    "SLOW",
    "WARNING_KEY",
    "Hits",
    "assert_same",
    "loaded_whole",
    "policy_warnings",
    "quiesce",
    "report",
    "request",
    "require_keys",
]

CHUNK = 256
BLOCK = 128  # vLLM's CPU block size
SHORT = 700  # chunks [0, 256), [256, 512) and a short [512, 700)
LONG = 2048  # eight whole chunks, 4 MiB of KV (2 layers x K, V x 2 heads x 64 x fp32)
SLOW = 1792  # the prefix loaded through the slow proxy in the decode test
REPS = 5  # prompts only Redis holds that the cost model weighs
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 64 * 4  # layers x (K, V) x KV heads x head size x fp32
MODEL_MODULE = "lmcache_async.bench.tiny_llama"  # builds the small random Llama (python -m)
WARNING_KEY = "kv_load_failure_policy"
WARNING_EVENT = "vllm_kv_load_failure_policy_fail"


def require_keys(*keys: str) -> None:
    """Fail at once, naming them, when connector or engine keys these tests set are not
    known yet (the features they configure are not built)."""
    from lmcache_async.config import EngineConfig
    from lmcache_async.integrations.vllm.settings import CONNECTOR_KEYS

    known = set(CONNECTOR_KEYS) | set(EngineConfig.field_names())
    missing = [key for key in keys if key not in known]
    if missing:
        pytest.fail(f"kv_connector_extra_config keys not known yet: {missing}")


def loaded_whole(counts: dict[str, int], tokens: int) -> bool:
    """Whether the connector loaded a prompt cached whole: all but its last token (down to
    a block boundary at most), every offered token loaded."""
    offered = counts["external_tokens"]
    return counts["loaded_tokens"] == offered and (tokens - 1) // BLOCK * BLOCK <= offered < tokens


class Hits:
    """The model, the prompts, a Redis server, the reference process and the storing run."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.model = root / "model"
        _run(["-m", MODEL_MODULE, str(self.model)], timeout=300)
        self._generator = torch.Generator().manual_seed(18)
        self.corrupt = [self.prompt(SHORT) for _ in range(3)]
        self.slow = self.prompt(SLOW)
        self.cost = [self.prompt(LONG) for _ in range(REPS)]
        self.redis = RedisServer(root / "redis").start()
        self.disk = root / "disk-stored"
        self._processes: list[StepsProcess] = []
        self.reference = self.process("ref", None)
        self._stored = False

    def prompt(self, length: int) -> list[int]:
        """A fresh random prompt (token ids 3..999)."""
        return torch.randint(3, 1000, (length,), generator=self._generator).tolist()

    def config(self, name: str, **extra: Any) -> dict[str, Any]:
        """A connector config of process ``name`` (its own lookup sockets)."""
        config: dict[str, Any] = {
            "chunk_size": CHUNK,
            "instance_id": f"h{os.getpid()}{name}",
            "socket_dir": str(self.root),
        }
        if "sidecar_url" not in extra:
            config["max_local_cpu_size"] = 0.25
        config.update(extra)
        return config

    def process(
        self,
        name: str,
        extra: dict[str, Any] | None,
        *flags: str,
        warm_up: bool = True,
        model: Path | None = None,
    ) -> StepsProcess:
        """Start vllm_steps.py with the connector config ``extra`` (None: the do-nothing
        connector) on ``model`` (default: the small one), then warm it up with two fresh
        prompts (the first steps of a process are slow)."""
        model = model or self.model
        args = ["--model", str(model), "--max-batched-tokens", str(CHUNK), *flags]
        if extra is None:
            args.append("--null-connector")
        else:
            args += ["--connector-config", json.dumps(self.config(name, **extra))]
        process = StepsProcess(args, self.root / f"{name}.log")
        self._processes.append(process)
        process.start()
        if warm_up:
            self.warm_up(process, 2)
        return process

    def warm_up(self, process: StepsProcess, count: int, length: int = LONG) -> None:
        for index in range(count):
            process.generate([{"id": f"warm{index}", "tokens": self.prompt(length)}])

    def close(self, process: StepsProcess) -> None:
        status = process.close()
        assert status == 0, f"runner exited with {status}:\n{process.log()[-3000:]}"

    def expected(self, prompts: list[list[int]], **spec: Any) -> list[dict[str, Any]]:
        """The reference outputs of ``prompts``, each generated alone."""
        return [
            self.reference.generate([request(i, p, **spec)])["results"][0]
            for i, p in enumerate(prompts)
        ]

    def store(self) -> None:
        """Once per module: a process with a disk tier and Redis stores the prompts the
        other tests look up, and checks that generated tokens are not stored by default."""
        if self._stored:
            return
        stored = self.process(
            "store",
            {
                "local_disk": str(self.disk),
                "remote_url": self.redis.url,
                "wait_for_slow_tiers": True,
            },
        )
        for index, prompt in enumerate([*self.corrupt, self.slow, *self.cost]):
            (result,) = stored.generate([request(index, prompt)])["results"]
            assert result["connector"]["stored_tokens"] == len(prompt)
        extended = self.extend_decoded(stored)
        # store_decode_tokens is off by default: only the prompt's whole chunk is a hit.
        assert extended["connector"]["external_tokens"] == CHUNK
        self.close(stored)
        self._stored = True

    def extend_decoded(self, process: StepsProcess) -> dict[str, Any]:
        """Generate 300 tokens after a fresh 300-token prompt, then run that prompt
        extended by what was generated (and 20 tokens more); the second result."""
        prompt = self.prompt(300)
        decode = request("d", prompt, max_tokens=300, ignore_eos=True)
        (first,) = process.generate([decode])["results"]
        assert len(first["token_ids"]) == 300
        extended = prompt + first["token_ids"] + self.prompt(20)
        second: dict[str, Any]
        (second,) = process.generate([request("e", extended)])["results"]
        (want,) = self.reference.generate([request("e", extended)])["results"]
        assert_same([want], [second], tolerance=LOGPROB_TOLERANCE)
        return second

    def chunk_files(self, prompt: list[int]) -> list[str]:
        """The disk tier's file names of ``prompt``'s chunks (the default tenant's)."""
        from lmcache_async.keys.chunks import ChunkHasher, ChunkKey, Namespace
        from lmcache_async.layouts import KVLayout

        layout = KVLayout.vllm_cpu(num_layers=2, num_kv_heads=2, head_size=64, dtype=torch.float32)
        hasher = ChunkHasher(
            Namespace(model_name=str(self.model), layout_fingerprint=layout.fingerprint),
            chunk_size=CHUNK,
        )
        return [f"{ChunkKey(digest).to_str()}.chunk" for digest in hasher.digests(prompt)]

    def shutdown(self) -> None:
        for process in self._processes:
            process.close()
        self.redis.stop()


def request(name: int | str, tokens: list[int], **spec: Any) -> dict[str, Any]:
    """A ``generate`` request (id ``name``, ``r<name>`` for a number): greedy, 4 tokens,
    3 logprobs unless ``spec`` says otherwise."""
    request_id = f"r{name}" if isinstance(name, int) else name
    return {"id": request_id, "tokens": tokens, "max_tokens": 4, "logprobs": 3, **spec}


def assert_same(
    expected: list[dict[str, Any]], got: list[dict[str, Any]], *, tolerance: float = 0.0
) -> None:
    """Every request completed with the reference's tokens; logprobs bit-identical (or
    within ``tolerance``), the same candidates."""
    assert len(got) == len(expected)
    for index, (want, have) in enumerate(zip(expected, got, strict=True)):
        assert have["finish_reason"] == "length" and not have["aborted"], (index, have)
        assert_same_result(index, want, have, tolerance=tolerance)


def policy_warnings(log: str) -> list[str]:
    """The connector's warning lines that name vLLM's kv_load_failure_policy (its event,
    whatever format the host's logging gives it)."""
    return [line for line in log.splitlines() if WARNING_EVENT in line and WARNING_KEY in line]


def report(label: str, value: Any) -> None:
    """Print a measured figure (shown with ``pytest -s``)."""
    print(f"{label}: {json.dumps(value)}")


def quiesce(process: StepsProcess, timeout: float = 30.0) -> None:
    """Wait until ``process`` has no slow-tier write queued, so the next measurement runs
    on a quiet machine."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(rank.get("tier_writes_pending", 0) == 0 for rank in process.stats()):
            return
        time.sleep(0.01)
    raise AssertionError("slow-tier writes still pending")
