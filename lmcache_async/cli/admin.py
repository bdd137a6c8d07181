"""``lmcache-async events``, ``ctl`` and ``stats``: watch and administer a running sidecar."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from lmcache_async.cli.common import EXIT_FAILED, EXIT_OK
from lmcache_async.errors import ConfigError, InvalidInputError
from lmcache_async.tenancy.tenants import check_tenant

if TYPE_CHECKING:
    from lmcache_async.rpc.curve import CurveClientKeys

__all__ = ["add_admin_parsers", "run_admin", "run_events"]


def add_admin_parsers(sub: Any) -> None:
    """Add ``events``, ``ctl`` and ``stats`` to the subcommands ``sub``."""

    def add_keys(cmd: argparse.ArgumentParser) -> None:
        cmd.add_argument(
            "--curve-public-key-file", metavar="FILE", help="the CURVE sidecar's public key"
        )
        cmd.add_argument(
            "--certificate",
            metavar="FILE",
            help="this client's zmq.auth secret certificate, on the sidecar's allow-list",
        )

    def add_url(cmd: argparse.ArgumentParser) -> None:
        cmd.add_argument("--url", default=None, help="the sidecar (default: its default ipc path)")
        cmd.add_argument(
            "--timeout",
            type=float,
            default=None,
            metavar="SECONDS",
            help="how long to wait for the answer (default 5, 60 for erase)",
        )
        add_keys(cmd)

    events = sub.add_parser(
        "events",
        help="print a sidecar's KV events live",
        description="Subscribe to the KV events a sidecar publishes (serve --events URL) in "
        "vLLM's format (BlockStored / BlockRemoved / AllBlocksCleared) and print one line per "
        "event until Ctrl-C or SIGTERM.",
    )
    events.add_argument("--connect", required=True, metavar="URL", help="the publisher's URL")
    events.add_argument("--json", action="store_true", help="one JSON object per line")
    events.add_argument("--count", type=int, default=None, metavar="N", help="stop after N batches")
    events.add_argument("--topic", default="", help="the topic to subscribe to (default: all)")
    events.add_argument(
        "--replay",
        default=None,
        metavar="URL",
        help="the publisher's replay socket (serve --events-replay): ask it for missed batches",
    )
    add_keys(events)
    ctl = sub.add_parser(
        "ctl",
        help="switch or query a running sidecar",
        description="freeze on|off, hot-cache on|off, clear, erase --tenant NAME, health. "
        "erase removes every chunk of a tenant from every tier and prints what each tier "
        "removed. Exit 1 when the sidecar does not answer within --timeout, refuses, could "
        "not erase some tier, or (health) is unhealthy.",
    )
    ctl.add_argument("action", choices=("freeze", "hot-cache", "clear", "erase", "health"))
    ctl.add_argument("state", nargs="?", choices=("on", "off"))
    whose = ctl.add_mutually_exclusive_group()
    whose.add_argument("--tenant", default=None, metavar="NAME", help="erase: the tenant")
    whose.add_argument(
        "--own-tenant",
        action="store_true",
        help="erase: the sidecar engine's own tenant (the one its clients name by default)",
    )
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
    stats.add_argument(
        "--by-tenant",
        action="store_true",
        help="print each tenant's lookups and usage of each tier instead",
    )


def run_events(args: argparse.Namespace) -> int:
    """Print the KV events published at ``--connect`` until ``--count`` or a signal.

    Raises:
        InvalidInputError: ``--count`` is below 1.
    """
    import anyio  # noqa: PLC0415

    from lmcache_async.rpc.event_subscriber import (  # noqa: PLC0415
        ReceivedBatch,
        format_batch,
        tail_events,
    )

    if args.count is not None and args.count < 1:
        raise InvalidInputError(f"--count must be >= 1, got {args.count}")

    def show(batch: ReceivedBatch) -> None:
        for line in format_batch(batch, as_json=args.json):
            print(line, flush=True)

    keys = _client_keys(args)
    anyio.run(
        lambda: tail_events(
            args.connect,
            show,
            topic=args.topic.encode(),
            replay=args.replay,
            count=args.count,
            keys=keys,
        )
    )
    return EXIT_OK


def _server_key(args: argparse.Namespace) -> bytes | None:
    """The sidecar's public key from ``--curve-public-key-file`` (None: no CURVE).

    Raises:
        ConfigError: the file holds no public key, or ``--certificate`` came without it.
    """
    from lmcache_async.rpc.curve import load_curve_public_key  # noqa: PLC0415

    if args.curve_public_key_file is None:
        if args.certificate is not None:
            raise ConfigError(
                "certificate", "--certificate needs the sidecar's --curve-public-key-file"
            )
        return None
    return load_curve_public_key(args.curve_public_key_file)


def _client_keys(args: argparse.Namespace) -> CurveClientKeys | None:
    """The CURVE keys the flags name (None: no CURVE).

    Raises:
        ConfigError: a key file or the certificate cannot be read.
    """
    from lmcache_async.rpc.curve import CurveClientKeys  # noqa: PLC0415

    key = _server_key(args)
    return None if key is None else CurveClientKeys.make(key, args.certificate)


def run_admin(args: argparse.Namespace) -> int:
    """Run ``ctl`` or ``stats`` against the sidecar at ``--url``; exit 1 when it does not
    answer, refuses, or (``ctl health``) is unhealthy.

    Raises:
        InvalidInputError: ``ctl`` got a state it does not take, or lacks one it needs;
            ``erase`` without a valid tenant, or a tenant for another action.
    """
    import json  # noqa: PLC0415

    import anyio  # noqa: PLC0415

    from lmcache_async.errors import EraseIncompleteError, LMCacheAsyncError  # noqa: PLC0415
    from lmcache_async.rpc import admin  # noqa: PLC0415
    from lmcache_async.rpc.erase import format_erase  # noqa: PLC0415
    from lmcache_async.rpc.transport import default_endpoint  # noqa: PLC0415

    if args.command == "ctl":
        _check_ctl(args)
    erasing = args.command == "ctl" and args.action == "erase"
    timeout = args.timeout
    if timeout is None:
        timeout = admin.DEFAULT_ERASE_TIMEOUT if erasing else admin.DEFAULT_ADMIN_TIMEOUT
    key = _server_key(args)
    url = default_endpoint() if args.url is None else args.url

    async def run(client: admin.AdminClient) -> tuple[str, bool]:
        if args.command == "stats":
            reply = await client.stats()
            if args.json:
                return json.dumps(reply, indent=2, default=repr), True
            if args.by_tenant:
                return admin.format_tenants(reply), True
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
        if erasing:
            try:
                removed = await client.erase(args.tenant, timeout=timeout)
            except EraseIncompleteError as exc:
                return format_erase(args.tenant, exc.removed, exc.failed), False
            return format_erase(args.tenant, removed), True
        on = args.state == "on"
        if args.action == "freeze":
            return f"freeze {'on' if await client.freeze(on) else 'off'}", True
        return f"hot cache {'on' if await client.set_hot_cache(on) else 'off'}", True

    with admin.AdminClient(
        url, timeout=timeout, server_public_key=key, client_certificate=args.certificate
    ) as client:
        try:
            text, ok = anyio.run(run, client)
        except LMCacheAsyncError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_FAILED
    print(text)
    return EXIT_OK if ok else EXIT_FAILED


def _check_ctl(args: argparse.Namespace) -> None:
    """InvalidInputError unless ``ctl``'s state and tenant fit its action."""
    action = args.action
    if (args.state is None) != (action in ("clear", "erase", "health")):
        raise InvalidInputError(
            f"ctl {action} takes {'on|off' if args.state is None else 'no state'}"
        )
    named = args.tenant is not None or args.own_tenant
    if action == "erase" and not named:
        raise InvalidInputError(
            "ctl erase needs --tenant NAME (or --own-tenant for the engine's own tenant)"
        )
    if action != "erase" and named:
        raise InvalidInputError(f"ctl {action} takes no tenant")
    check_tenant(args.tenant)
