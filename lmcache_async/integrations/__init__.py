"""Adapters between lmcache_async and serving engines.

Each integration lives in its own module and imports its serving engine only there, so
``import lmcache_async.integrations`` never needs vLLM or transformers installed:

* :mod:`lmcache_async.integrations.vllm` — ``LMCacheAsyncConnector``, a vLLM v1 KV
  connector (``kv_connector_module_path="lmcache_async.integrations.vllm"``);
* :mod:`lmcache_async.integrations.transformers` — helpers for HuggingFace transformers'
  KV caches.

May import: the public API (``lmcache_async``) and every layer under it. Never ``cli`` or
``bench``.
"""

from __future__ import annotations

__all__: list[str] = []
