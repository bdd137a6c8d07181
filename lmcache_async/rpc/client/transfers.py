"""A client's data path: stores (:mod:`~.stores`) and retrieves (:mod:`~.loads`) between
the serving engine's KV caches and the sidecar's payloads, with the KV copies run here
(:mod:`~.copies`); the sidecar's request core decides what is stored and loaded.
"""

from __future__ import annotations

from lmcache_async.layouts import KVCacheViews, KVLayout
from lmcache_async.rpc.client.ahead import StoresAhead
from lmcache_async.rpc.client.connection import Connection
from lmcache_async.rpc.client.copies import CopyPath
from lmcache_async.rpc.client.lends import Lends
from lmcache_async.rpc.client.loads import Loads
from lmcache_async.rpc.client.stores import Stores
from lmcache_async.transfer.cuda import Transfers

__all__ = ["DataPath"]


class DataPath:
    """Stores and retrieves over ``conn`` between the serving engine's KV caches (checked
    against ``layout`` once, by ``kv_views``) and the sidecar's payloads, the copies run
    by ``transfers``. A retrieve under a pinned lookup's id loads what it lent
    (``lends``) when it can; a store takes the STORE sent ahead of it (``ahead``)."""

    def __init__(
        self,
        conn: Connection,
        layout: KVLayout,
        kv_views: KVCacheViews,
        transfers: Transfers,
        *,
        lends: Lends,
        ahead: StoresAhead,
    ) -> None:
        self._copies = CopyPath(conn, layout, kv_views, transfers)
        self.stores = Stores(conn, self._copies, ahead)
        self.loads = Loads(conn, self._copies, lends)

    async def aclose(self) -> None:
        """Stop the copy threads and forget the KV caches seen (shielded)."""
        await self._copies.aclose()
