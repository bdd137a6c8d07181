"""``lmcache-async serve``: run the sidecar cache server in this process."""

from __future__ import annotations

import argparse
from typing import Any, Final

from lmcache_async.cli.common import EXIT_OK
from lmcache_async.config import EngineConfig
from lmcache_async.errors import ConfigError

__all__ = ["add_serve_parser", "run_serve"]

# Configuration keys ``serve`` does not take as flags: logging has its own global options.
_SERVE_SKIPPED_KEYS: Final = frozenset({"log_level", "log_format"})


def add_serve_parser(sub: Any) -> None:
    """Add ``serve`` to the subcommands ``sub``: its own flags, and one per configuration
    key."""
    serve = sub.add_parser(
        "serve",
        help="run the sidecar cache server",
        description="Run the cache's storage tiers in this process, serving "
        "RemoteCacheEngine clients over ZeroMQ, until SIGTERM or SIGINT. Every "
        "configuration key is also a flag (--max-local-cpu-size 2 --local-disk /path) that "
        "overrides the file and the environment.",
    )
    serve.add_argument(
        "--listen",
        default=None,
        metavar="URL",
        help="ipc://PATH or tcp://HOST:PORT (default: ipc://TMPDIR/lmcache-async-sidecar-UID.sock)",
    )
    serve.add_argument("--config", metavar="FILE.yaml", help="engine configuration file")
    serve.add_argument(
        "--allow-remote",
        action="store_true",
        help="allow a tcp bind beyond loopback (use with --curve-secret-key-file)",
    )
    serve.add_argument(
        "--curve-secret-key-file",
        metavar="FILE",
        help="CURVE secret key (a zmq certificate or the z85 key): encrypt the traffic and "
        "refuse clients without the server's public key",
    )
    serve.add_argument(
        "--heartbeat-interval",
        type=float,
        default=None,
        metavar="SECONDS",
        help="seconds between client heartbeats (default 1)",
    )
    serve.add_argument(
        "--client-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="drop a silent client's transactions and pins after this (default: 5 heartbeats)",
    )
    serve.add_argument(
        "--events",
        default=None,
        metavar="URL",
        help="publish KV events (chunks stored / removed) on a PUB socket at this ipc:// or "
        "tcp:// URL (see lmcache-async events)",
    )
    serve.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics on http://127.0.0.1:PORT/metrics (0: any free port)",
    )
    namespace = serve.add_argument_group("namespace (default: fixed by the first client's hello)")
    namespace.add_argument("--model-name", default=None)
    namespace.add_argument("--revision", default=None)
    namespace.add_argument("--tenant", default=None)
    namespace.add_argument(
        "--layout", default=None, metavar="JSON", help="KVLayout.to_dict() as JSON"
    )
    keys = serve.add_argument_group("configuration keys (override --config)")
    for name in EngineConfig.field_names():
        if name not in _SERVE_SKIPPED_KEYS:
            keys.add_argument(
                "--" + name.replace("_", "-"), dest="key_" + name, metavar="VALUE", default=None
            )


def run_serve(args: argparse.Namespace) -> int:
    """Serve the sidecar until SIGTERM or SIGINT, printing its endpoints once it listens.

    Raises:
        ConfigError: the configuration, the namespace flags or the CURVE key are invalid.
        OSError: the endpoint cannot be bound.
    """
    import json  # noqa: PLC0415

    import anyio  # noqa: PLC0415

    from lmcache_async.config import ENV_PREFIX  # noqa: PLC0415
    from lmcache_async.layouts import KVLayout  # noqa: PLC0415
    from lmcache_async.rpc.sidecar import (  # noqa: PLC0415
        DEFAULT_HEARTBEAT_INTERVAL,
        SidecarNamespace,
        SidecarServer,
        SidecarSettings,
        serve,
    )
    from lmcache_async.rpc.transport import (  # noqa: PLC0415
        default_endpoint,
        load_curve_secret_key,
    )

    # Flag values are text: parse them by each key's type, as environment variables are.
    given = {
        ENV_PREFIX + name.upper(): getattr(args, "key_" + name)
        for name in EngineConfig.field_names()
        if name not in _SERVE_SKIPPED_KEYS and getattr(args, "key_" + name) is not None
    }
    config = EngineConfig.load(args.config, **EngineConfig.env_overrides(given))
    namespace = None
    if args.model_name is not None or args.layout is not None:
        if args.model_name is None or args.layout is None:
            raise ConfigError("namespace", "--model-name and --layout go together")
        try:
            layout = KVLayout.from_dict(json.loads(args.layout))
        except ValueError as exc:
            raise ConfigError("layout", str(exc)) from None
        namespace = SidecarNamespace(args.model_name, layout, args.revision, args.tenant)
    curve = None
    if args.curve_secret_key_file is not None:
        curve = load_curve_secret_key(args.curve_secret_key_file)
    heartbeat = args.heartbeat_interval
    settings = SidecarSettings(
        listen=default_endpoint() if args.listen is None else args.listen,
        config=config,
        namespace=namespace,
        heartbeat_interval=DEFAULT_HEARTBEAT_INTERVAL if heartbeat is None else heartbeat,
        client_timeout=args.client_timeout,
        allow_remote=args.allow_remote,
        curve_secret_key=curve,
        events=args.events,
        metrics_port=args.metrics_port,
    )

    def ready(server: SidecarServer) -> None:
        print(f"lmcache-async serve: listening on {server.endpoint}", flush=True)
        if server.publisher is not None:
            print(f"lmcache-async serve: KV events on {server.publisher.endpoint}", flush=True)
        if server.metrics is not None:
            print(f"lmcache-async serve: metrics on {server.metrics.url}", flush=True)

    async def run() -> None:
        await serve(settings, on_ready=ready)

    anyio.run(run)
    return EXIT_OK
