"""Shared fixtures: async tests run on asyncio through anyio's pytest plugin."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
import structlog

if TYPE_CHECKING:
    from tests.servers import RedisCluster, RedisServer


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked ``cuda`` cleanly when no CUDA device is present."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """Put the root logger's handlers and level and structlog's configuration back as
    they were (for tests of commands that configure logging)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    saved = structlog.get_config()
    yield
    for handler in list(root.handlers):
        if handler not in handlers:
            root.removeHandler(handler)
            handler.close()
    root.setLevel(level)
    structlog.configure(**saved)


@pytest.fixture
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A fresh standalone ``redis-server`` on a free loopback port, stopped after the test.

    Fails (does not skip) when redis-server is missing: run ``make redis``.
    """
    from tests.servers import RedisServer

    with RedisServer(tmp_path_factory.mktemp("redis")).start() as server:
        yield server


@pytest.fixture(scope="session")
def _redis_cluster_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    from tests.servers import RedisCluster

    with RedisCluster(tmp_path_factory.mktemp("redis-cluster")).start() as cluster:
        yield cluster


@pytest.fixture
def redis_cluster(_redis_cluster_session: RedisCluster) -> RedisCluster:
    """A 3-node Redis Cluster on loopback (shared by the session), emptied for each test."""
    cluster = _redis_cluster_session
    if not all(node.running for node in cluster.nodes):
        cluster.restart()
    cluster.flushall()
    return cluster
