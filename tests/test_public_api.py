"""The package's public API is exactly what ``lmcache_async.__all__`` lists."""

from __future__ import annotations
import __future__

import types

import lmcache_async

REQUIRED = {
    "CacheEngine",
    "SyncCacheEngine",
    "EngineConfig",
    "KVLayout",
    "EngineStats",
    "KVEvent",
    "LMCacheAsyncError",
    "InvalidInputError",
    "ConfigError",
    "AllocationTimeoutError",
    "EngineClosedError",
    "KVCacheClient",
}


def test_all_names_exist() -> None:
    missing = [name for name in lmcache_async.__all__ if not hasattr(lmcache_async, name)]
    assert not missing


def test_all_has_no_duplicates_and_is_strings() -> None:
    names = list(lmcache_async.__all__)
    assert all(isinstance(n, str) for n in names)
    assert len(names) == len(set(names))


def test_every_public_attribute_is_in_all() -> None:
    public = {
        name
        for name, value in vars(lmcache_async).items()
        if not name.startswith("_")
        and not isinstance(value, types.ModuleType)
        # `from __future__ import annotations` binds a compiler flag, not an export.
        and not isinstance(value, __future__._Feature)
    }
    assert public - set(lmcache_async.__all__) == set()


def test_required_names_are_exported() -> None:
    assert set(lmcache_async.__all__) >= REQUIRED


def test_star_import_gives_exactly_all() -> None:
    namespace: dict[str, object] = {}
    exec("from lmcache_async import *", namespace)
    namespace.pop("__builtins__", None)
    assert set(namespace) == set(lmcache_async.__all__)


def test_errors_are_the_errors_module_classes() -> None:
    from lmcache_async import errors

    for name in errors.__all__:
        if name in lmcache_async.__all__:
            assert getattr(lmcache_async, name) is getattr(errors, name)


def test_both_engines_satisfy_the_client_protocol() -> None:
    """``CacheEngine`` and ``RemoteCacheEngine`` have every member of ``KVCacheClient``."""
    protocol_members = {
        name for name in vars(lmcache_async.KVCacheClient) if not name.startswith("_")
    }
    assert {"store", "retrieve", "lookup", "prefetch", "lookup_unpin"} <= protocol_members
    for cls in (lmcache_async.CacheEngine, lmcache_async.RemoteCacheEngine):
        missing = {name for name in protocol_members if not hasattr(cls, name)}
        assert not missing, (cls.__name__, missing)
