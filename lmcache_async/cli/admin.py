"""``lmcache-async events``, ``ctl`` and ``stats``: watch and administer a running sidecar."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from lmcache_async.cli.common import EXIT_FAILED, EXIT_OK
from lmcache_async.errors import InvalidInputError

__all__ = ["add_admin_parsers", "run_admin", "run_events"]


def add_admin_parsers(sub: Any) -> None:
    """Add ``events``, ``ctl`` and ``stats`` to the subcommands ``sub``."""

    def add_url(cmd: argparse.ArgumentParser) -> None:
        cmd.add_argument("--url", default=None, help="the sidecar (default: its default ipc path)")
        cmd.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS")
        cmd.add_argument(
            "--curve-public-key-file", metavar="FILE", help="the CURVE sidecar's public key"
        )

    events = sub.add_parser(
        "events",
        help="print a sidecar's KV events live",
        description="Subscribe to the KV events (chunks stored / removed) a sidecar publishes "
        "(serve --events URL) and print one line per event until Ctrl-C or SIGTERM.",
    )
    events.add_argument("--connect", required=True, metavar="URL", help="the publisher's URL")
    events.add_argument("--json", action="store_true", help="one JSON object per line")
    events.add_argument("--count", type=int, default=None, metavar="N", help="stop after N")
    events.add_argument("--topic", default="kv")
    ctl = sub.add_parser(
        "ctl",
        help="switch or query a running sidecar",
        description="freeze on|off, hot-cache on|off, clear, health. Exit 1 when the sidecar "
        "does not answer within --timeout, refuses, or (health) is unhealthy.",
    )
    ctl.add_argument("action", choices=("freeze", "hot-cache", "clear", "health"))
    ctl.add_argument("state", nargs="?", choices=("on", "off"))
    add_url(ctl)
    stats = sub.add_parser(
        "stats",
        help="print a running sidecar's stats",
        description="Tiers, pool usage, hit rate, throughput and latency percentiles.",
    )
    add_url(stats)
    stats.add_argument("--json", action="store_true", help="print the raw reply as JSON")
    stats.add_argument(
        "--interval",
        type=float,
        default=None,
        metavar="SECONDS",
        help="measure throughput over this interval (default: since the server started)",
    )


def run_events(args: argparse.Namespace) -> int:
    """Print the KV events published at ``--connect`` until ``--count`` or a signal.

    Raises:
        InvalidInputError: ``--count`` is below 1.
    """
    import anyio  # noqa: PLC0415

    from lmcache_async.rpc.events import ReceivedEvent, format_event, tail_events  # noqa: PLC0415

    if args.count is not None and args.count < 1:
        raise InvalidInputError(f"--count must be >= 1, got {args.count}")

    def show(received: ReceivedEvent) -> None:
        print(format_event(received, as_json=args.json), flush=True)

    anyio.run(lambda: tail_events(args.connect, show, topic=args.topic.encode(), count=args.count))
    return EXIT_OK


def run_admin(args: argparse.Namespace) -> int:
    """Run ``ctl`` or ``stats`` against the sidecar at ``--url``; exit 1 when it does not
    answer, refuses, or (``ctl health``) is unhealthy.

    Raises:
        InvalidInputError: ``ctl`` got a state it does not take, or lacks one it needs.
    """
    import json  # noqa: PLC0415

    import anyio  # noqa: PLC0415

    from lmcache_async.errors import LMCacheAsyncError  # noqa: PLC0415
    from lmcache_async.rpc import admin  # noqa: PLC0415
    from lmcache_async.rpc.transport import default_endpoint  # noqa: PLC0415

    if args.command == "ctl" and (args.state is None) != (args.action in ("clear", "health")):
        raise InvalidInputError(
            f"ctl {args.action} takes {'on|off' if args.state is None else 'no state'}"
        )
    key = None
    if args.curve_public_key_file is not None:
        key = admin.load_curve_public_key(args.curve_public_key_file)
    url = default_endpoint() if args.url is None else args.url

    async def run(client: admin.AdminClient) -> tuple[str, bool]:
        if args.command == "stats":
            reply = await client.stats()
            if args.json:
                return json.dumps(reply, indent=2, default=repr), True
            previous = None
            if args.interval:
                previous = reply
                await anyio.sleep(args.interval)
                reply = await client.stats()
            return admin.format_stats(reply, previous=previous, interval=args.interval), True
        if args.action == "health":
            reply = await client.health()
            return admin.format_health(reply), bool(reply.get("healthy"))
        if args.action == "clear":
            return f"cleared {await client.clear()} chunks", True
        on = args.state == "on"
        if args.action == "freeze":
            return f"freeze {'on' if await client.freeze(on) else 'off'}", True
        return f"hot cache {'on' if await client.set_hot_cache(on) else 'off'}", True

    with admin.AdminClient(url, timeout=args.timeout, server_public_key=key) as client:
        try:
            text, ok = anyio.run(run, client)
        except LMCacheAsyncError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_FAILED
    print(text)
    return EXIT_OK if ok else EXIT_FAILED
