"""Faults and memory pressure under load never stall a caller nor fail a request.

The load generator (in this process, through its Python API) drives a real ``lmcache-async
serve`` with a CPU tier smaller than one conversation's prompt times the requests in flight,
a disk tier and a real Redis, while Redis and then the sidecar are SIGKILLed and restarted
(:mod:`tests.rpc.chaos`: each fault comes after a number of requests has ended, never after
a sleep). Every retrieve is checked bit for bit, no request may fail, and no call may hold
its caller past :data:`LONGEST_CALL`, a bound derived from the client's timeout.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path
from typing import Final

import anyio
import pytest

from lmcache_async.logging import configure_logging
from tests.rpc.chaos import SMALL, Chaos, chaos_run, figures

CLIENT_TIMEOUT: Final = 4.0
"""The client's timeout of one request (``RemoteCacheEngine(timeout=)``)."""

LONGEST_CALL: Final = 5 * CLIENT_TIMEOUT
"""The longest a lookup, retrieve or store may hold its caller. A call's requests to the
sidecar share one deadline, the client's timeout; after it come only best-effort notices
(an aborted commit, a release, an unpin: each sent at once unless the socket's queue is
full, and bounded by the timeout) and copies out of the shared segment (a few MiB,
milliseconds: the longest call of a whole run on a busy 2-core machine takes well under a
second). Five timeouts hold the deadline, two notices after it and more local work than
any busy machine needs, so noise cannot break it; a call waiting without a deadline can."""

RUN_LIMIT: Final = 250.0
"""Seconds the whole run may take (it takes about 30 on an idle 2-core machine); below
pytest's own limit of 300 s, so a stalled run ends in this test's cleanup (its sidecar and
Redis stopped) rather than in pytest's watchdog."""

CHAOS: Final = Chaos(kill_redis=24, restart_redis=24, kill_sidecar=24, after=32)

SIDECAR_FLAGS: Final = [
    "--chunk-size",
    "256",
    # 12 MiB: a prompt's KV is up to 16 MiB (4096 tokens of 4 KiB), four are in flight.
    "--max-local-cpu-size",
    "0.012",
    "--heartbeat-interval",
    "0.5",
]


@pytest.fixture(autouse=True)
def _log_to_stderr(restore_logging: None) -> None:
    configure_logging("WARNING", stream=sys.stderr)


@pytest.mark.anyio
@pytest.mark.subprocess
@pytest.mark.slow
async def test_faults_and_memory_pressure_never_stall_nor_fail_a_request(tmp_path: Path) -> None:
    # A closed loop: four requests in flight all the time, the most pressure on the pool.
    options = dataclasses.replace(SMALL, sidecar_timeout=CLIENT_TIMEOUT, verify_every=1)
    with anyio.fail_after(RUN_LIMIT):
        result = await chaos_run(options, CHAOS, workdir=tmp_path, sidecar_flags=SIDECAR_FLAGS)
    print("\n" + figures(result))  # the figures quoted in the notes (pytest -s)
    res = result.results

    assert [name for name, _, _ in result.stages] == ["kill_redis", "restart_redis", "kill_sidecar"]
    assert res["requests"] >= CHAOS.requests
    # Nothing failed: no exception reached a caller, no request timed out in the client.
    assert res["errors_total"] == 0, res["errors"]
    assert res["verify_failures"] == 0
    # Every retrieve that loaded anything was checked, bit for bit, and many did.
    loading = sum(1 for n in res["samples"]["loaded_tokens"] if n > 0)
    assert res["verified_retrieves"] == loading >= CHAOS.requests // 4
    # The pool was under pressure (a prompt fills much of it): chunks were evicted, and
    # chunks were read back from disk or Redis into it.
    assert result.first_stats["evicted_chunks"] > 0
    assert result.first_stats["promoted_chunks"] > 0
    # No call was left waiting: none held its caller past what its timeout allows.
    for op in ("lookup", "retrieve", "store"):
        longest = res["latency_ms"][op]["max"]
        assert not math.isnan(longest), op
        assert longest <= LONGEST_CALL * 1e3, (op, longest)
    # A second sidecar served the end of the run: the client reconnected by itself.
    first, second = result.sidecar_logs
    assert "sidecar_namespace_fixed" in first
    assert "sidecar_namespace_fixed" in second
