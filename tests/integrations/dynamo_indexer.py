"""NVIDIA Dynamo's standalone KV indexer for the tests: the harness of the routing
benchmark (:mod:`lmcache_async.bench.routing.indexer`), and a skip when it is missing."""

from __future__ import annotations

import pytest

from lmcache_async.bench.routing.indexer import DynamoIndexer, IndexedBlock, IndexerError, TierMatch

__all__ = ["DynamoIndexer", "IndexedBlock", "IndexerError", "TierMatch", "require_dynamo_indexer"]


def require_dynamo_indexer() -> None:
    """Skip the calling test module when ``dynamo.indexer`` is not installed (the test
    install, ``make dev``, brings it)."""
    pytest.importorskip(
        "dynamo.indexer", reason="ai-dynamo-runtime is not installed (run `make dev`)"
    )
