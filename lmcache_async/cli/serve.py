"""``lmcache-async serve``: run the sidecar cache server in this process."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
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
    serve.add_argument(
        "--no-stream",
        action="store_true",
        help="serve same-host clients over ZeroMQ only (default: an ipc:// sidecar without "
        "CURVE keys also listens on the Unix stream socket PATH.stream, a faster round trip)",
    )
    serve.add_argument("--config", metavar="FILE.yaml", help="engine configuration file")
    serve.add_argument(
        "--allow-remote",
        action="store_true",
        help="allow a tcp bind beyond loopback (needs --curve-secret-key-file and --curve-clients)",
    )
    access = serve.add_argument_group("who may connect (CURVE)")
    access.add_argument(
        "--curve-secret-key-file",
        metavar="FILE",
        help="CURVE secret key (a zmq.auth secret certificate or the z85 key): encrypt the "
        "traffic and serve only the certificates of --curve-clients and --curve-admins",
    )
    access.add_argument(
        "--curve-clients",
        metavar="DIR",
        help="directory of zmq.auth public certificates that may store, retrieve, look up, "
        "prefetch, promise and subscribe to events",
    )
    access.add_argument(
        "--curve-admins",
        metavar="DIR",
        help="directory of public certificates that may also erase, clear, freeze, "
        "hot-cache, move, shut down and read per-tenant figures",
    )
    access.add_argument(
        "--move-targets",
        nargs="+",
        default=(),
        metavar="URL[=KEYFILE]",
        help="sidecars a MOVE may go to, each with its CURVE public key file (a target "
        "without one must be on this host)",
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
        "tcp:// URL (see lmcache-async events); under CURVE only allowed certificates "
        "subscribe",
    )
    serve.add_argument(
        "--events-replay",
        default=None,
        metavar="URL",
        help="answer replay requests of subscribers that missed batches on a ROUTER socket "
        "at this URL (vLLM's replay_endpoint convention)",
    )
    serve.add_argument(
        "--events-topic", default="", metavar="TOPIC", help="the topic of every event batch"
    )
    serve.add_argument(
        "--events-tenants",
        action="store_true",
        help="publish named tenants' events too (their prompts' tokens and digests); "
        "default: only the unnamed tenant's",
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
    from lmcache_async.rpc.curve import load_curve_secret_key  # noqa: PLC0415
    from lmcache_async.rpc.sidecar import (  # noqa: PLC0415
        DEFAULT_HEARTBEAT_INTERVAL,
        SidecarNamespace,
        SidecarServer,
        SidecarSettings,
        serve,
    )
    from lmcache_async.rpc.sidecar.access import AccessList  # noqa: PLC0415
    from lmcache_async.rpc.transport import default_endpoint  # noqa: PLC0415

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
    if args.curve_admins is not None and args.curve_clients is None:
        raise ConfigError("curve_admins", "--curve-admins goes with --curve-clients")
    access = (
        None
        if args.curve_clients is None
        else AccessList.load(args.curve_clients, args.curve_admins)
    )
    heartbeat = args.heartbeat_interval
    settings = SidecarSettings(
        listen=default_endpoint() if args.listen is None else args.listen,
        config=config,
        namespace=namespace,
        heartbeat_interval=DEFAULT_HEARTBEAT_INTERVAL if heartbeat is None else heartbeat,
        client_timeout=args.client_timeout,
        allow_remote=args.allow_remote,
        curve_secret_key=curve,
        access=access,
        move_targets=_move_targets(args.move_targets),
        events=args.events,
        events_replay=args.events_replay,
        events_topic=args.events_topic,
        tenant_events=args.events_tenants,
        metrics_port=args.metrics_port,
        stream=not args.no_stream,
    )

    def ready(server: SidecarServer) -> None:
        print(f"lmcache-async serve: listening on {server.endpoint}", flush=True)
        if server.stream_listener is not None:
            stream = server.stream_listener.getsockname()
            print(f"lmcache-async serve: same-host stream on {stream}", flush=True)
        if server.publisher is not None:
            print(f"lmcache-async serve: KV events on {server.publisher.endpoint}", flush=True)
        if server.metrics is not None:
            print(f"lmcache-async serve: metrics on {server.metrics.url}", flush=True)

    async def run() -> None:
        await serve(settings, on_ready=ready)

    anyio.run(run)
    return EXIT_OK


def _move_targets(given: Sequence[str]) -> dict[str, bytes | None]:
    """``--move-targets``: each ``URL`` or ``URL=KEYFILE``, the key read from its file.

    Raises:
        ConfigError: ``field="move_targets"``: a key file that holds no public key.
    """
    from lmcache_async.rpc.curve import load_curve_public_key  # noqa: PLC0415

    targets: dict[str, bytes | None] = {}
    for item in given:
        url, sep, key_file = item.partition("=")
        targets[url] = load_curve_public_key(key_file, field="move_targets") if sep else None
    return targets
