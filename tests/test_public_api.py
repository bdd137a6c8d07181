"""The package's public API is exactly what ``lmcache_async.__all__`` lists, and both engines
have the signatures of the ``KVCacheClient`` protocol."""

from __future__ import annotations
import __future__

import importlib
import inspect
import re
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

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


README = Path(__file__).resolve().parent.parent / "README.md"


def readme_paths() -> list[str]:
    """Every dotted ``lmcache_async...`` path the README names (``.__all__`` aside)."""
    found = re.findall(r"\blmcache_async(?:\.[A-Za-z_][A-Za-z0-9_]*)+", README.read_text())
    return sorted({path for path in found if not path.endswith(".__all__")})


def test_the_readme_names_module_paths() -> None:
    assert {"lmcache_async.integrations.vllm", "lmcache_async.rpc.lookup"} <= set(readme_paths())


@pytest.mark.parametrize("path", readme_paths())
def test_every_path_the_readme_names_imports(path: str) -> None:
    """A module path from the README imports; a path to a name resolves to that name."""
    module, _, name = path.rpartition(".")
    try:
        importlib.import_module(path)
    except ModuleNotFoundError:
        assert hasattr(importlib.import_module(module), name), path


def test_every_name_in_all_imports_from_the_package() -> None:
    for name in lmcache_async.__all__:
        namespace: dict[str, object] = {}
        exec(f"from lmcache_async import {name}", namespace)
        assert namespace[name] is getattr(lmcache_async, name)


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


def _protocol_members() -> list[str]:
    return [name for name in vars(lmcache_async.KVCacheClient) if not name.startswith("_")]


def _shape(function: Callable[..., Any]) -> list[tuple[str, object, object]]:
    """Each parameter's name, kind and default, in order."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


def test_the_protocol_names_the_calls_of_a_client() -> None:
    assert set(_protocol_members()) >= {
        "store",
        "retrieve",
        "lookup",
        "prefetch",
        "promise",
        "lookup_unpin",
        "clear",
        "is_healthy",
        "closed",
        "aclose",
    }


@pytest.mark.parametrize("engine", [lmcache_async.CacheEngine, lmcache_async.RemoteCacheEngine])
@pytest.mark.parametrize("name", _protocol_members())
def test_both_engines_have_the_protocols_signatures(engine: type, name: str) -> None:
    """Each member of ``KVCacheClient`` is on both engines with the same parameters (names,
    kinds, defaults, in order), awaited or not alike, and a property where it is one."""
    declared = inspect.getattr_static(lmcache_async.KVCacheClient, name)
    found = inspect.getattr_static(engine, name, None)
    assert found is not None, f"{engine.__name__} has no {name}"
    if isinstance(declared, property):
        assert isinstance(found, property), f"{engine.__name__}.{name} is not a property"
        assert found.fget is not None and declared.fget is not None
        declared, found = declared.fget, found.fget
    assert callable(declared) and callable(found)
    assert _shape(found) == _shape(declared), f"{engine.__name__}.{name}"
    assert inspect.iscoroutinefunction(found) == inspect.iscoroutinefunction(declared), name
