"""The sidecar cache server's former home, kept so existing imports still work.

The server now lives in the package :mod:`lmcache_async.rpc.sidecar` (settings, sessions,
handlers by concern, the server object and the process shell); the listen-address checks,
CURVE key loading and the boot id in :mod:`lmcache_async.rpc.transport`. New code imports
from there.
"""

from __future__ import annotations

from lmcache_async.rpc.sidecar import (
    DEFAULT_HEARTBEAT_INTERVAL,
    DEFAULT_SIDECAR_LIMITS,
    SidecarNamespace,
    SidecarServer,
    SidecarSettings,
    serve,
)
from lmcache_async.rpc.transport import (
    boot_id,
    check_listen_url,
    default_endpoint,
    load_curve_secret_key,
)

__all__ = [
    "DEFAULT_HEARTBEAT_INTERVAL",
    "DEFAULT_SIDECAR_LIMITS",
    "SidecarNamespace",
    "SidecarServer",
    "SidecarSettings",
    "boot_id",
    "check_listen_url",
    "default_endpoint",
    "load_curve_secret_key",
    "serve",
]
