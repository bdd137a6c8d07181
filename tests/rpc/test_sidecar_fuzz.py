"""The sidecar's wire protocol under a seeded fuzzer (tests/rpc/wire_fuzz.py) against a
real ``lmcache-async serve`` process: no hostile message gets an ``internal`` reply, a
traceback or no reply where one is due; the sidecar keeps serving a well-behaved client
byte-exact after every batch; and once the hostile sessions are reaped its open
transactions are back to 0 and its descriptors and memory near what they were before.

The long run (20,000 messages and more) is opt-in, because ``make test`` runs the slow
tests too: set ``LMCACHE_ASYNC_LONG_FUZZ=1``, or run
``python -m tests.rpc.wire_fuzz --messages 20000 --seed 1``.
"""

from __future__ import annotations

import os
from pathlib import Path

import anyio
import pytest

from tests.rpc.fuzz_plan import FD_MARGIN, GARBAGE, KINDS, RSS_MARGIN_KIB, SCRIPTS, plan
from tests.rpc.wire_fuzz import FuzzSummary, fuzz, started_sidecar

pytestmark = [pytest.mark.anyio, pytest.mark.subprocess]

FAST_MESSAGES = 2_000
LONG_MESSAGES = 20_000
LONG_ENV = "LMCACHE_ASYNC_LONG_FUZZ"


def test_the_plan_is_drawn_from_the_seed_alone() -> None:
    first, again, other = plan(5, 2, 40), plan(5, 2, 40), plan(6, 2, 40)
    assert first == again
    assert first != other
    assert [len(batch.cases) for batch in first] == [40, 40 + len(GARBAGE)]


def assert_clean(summary: FuzzSummary, messages: int) -> None:
    """Nothing failed, and every class of hostile input was sent and answered."""
    text = summary.text()
    assert summary.failures == [], text
    assert summary.messages >= messages, text
    for code in ("ok", "protocol", "invalid_input", "no_session", "unsupported", "forbidden"):
        assert summary.replies[code] > 0, (code, text)
    assert summary.silent > 0, text  # RELEASEs answered by nothing, as documented
    sent = set(summary.kinds)
    assert {kind.name for kind in KINDS} <= sent, sorted(sent)
    assert {f"garbage:{how}" for how in GARBAGE} <= sent, sorted(sent)
    assert {f"script:{name}" for name in SCRIPTS} <= sent, sorted(sent)
    assert summary.abandoned_sessions > 0, text
    assert summary.deaf_requests > 0, text
    assert summary.peak_transactions > 0, text  # sessions did hold payloads...
    assert summary.transactions_after == 0, text  # ...and gave every one back
    assert summary.fds_after <= summary.fds_before + FD_MARGIN, text
    assert summary.rss_after_kib <= summary.rss_before_kib + RSS_MARGIN_KIB, text


async def test_a_seeded_fuzz_of_every_message_leaves_the_sidecar_serving_and_clean(
    tmp_path: Path,
) -> None:
    with started_sidecar(tmp_path) as sidecar, anyio.fail_after(240):
        summary = await fuzz(sidecar, messages=FAST_MESSAGES, seed=1)
        assert sidecar.alive(), sidecar.log()[-3000:]
    assert_clean(summary, FAST_MESSAGES)


@pytest.mark.slow
@pytest.mark.timeout(1_000)
@pytest.mark.skipif(not os.environ.get(LONG_ENV), reason=f"a long fuzz: set {LONG_ENV}=1")
async def test_a_long_seeded_fuzz_leaves_the_sidecar_serving_and_clean(tmp_path: Path) -> None:
    with started_sidecar(tmp_path) as sidecar, anyio.fail_after(900):
        summary = await fuzz(sidecar, messages=LONG_MESSAGES, seed=2)
        assert sidecar.alive(), sidecar.log()[-3000:]
    assert_clean(summary, LONG_MESSAGES)
