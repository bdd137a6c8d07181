"""The chaos run: the load generator against a real sidecar with a CPU tier smaller than
the working set, a disk tier and a real Redis, while Redis and then the sidecar are
SIGKILLed and restarted mid-run.

The faults follow the run's progress, never a clock: each stage of :class:`Chaos` fires
once the given number of requests has ended (the load generator's ``on_request`` hook),
and the next stage counts from the request at which the previous one was carried out.
Redis is killed and brought back on the same port; the sidecar is killed and a new one
started on the same socket and disk directory (the client reconnects by itself).

Used by ``tests/rpc/test_sidecar_chaos.py``; run it alone, at the issue's scale, with::

    .venv/bin/python -m tests.rpc.chaos --full

It prints the figures (longest waits, p50/p99, errors, verified) and the stage timeline.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Final

import anyio
import anyio.to_thread

from lmcache_async import EngineConfig, LMCacheAsyncError
from lmcache_async.bench.loadgen import LoadOptions, format_summary, run_load_async
from lmcache_async.bench.loadgen.tally import Tally
from lmcache_async.rpc.admin import AdminClient
from tests.rpc.test_sidecar import ping
from tests.servers import RedisServer

__all__ = ["Chaos", "ChaosResult", "SidecarProcess", "chaos_run", "figures"]

READY_TIMEOUT: Final = 90.0
"""Seconds a sidecar gets to answer a PING after it is started (torch imports slowly)."""
STOP_TIMEOUT: Final = 30.0
STATS_TIMEOUT: Final = 5.0
_MOST_REQUESTS: Final = 100
"""A run starts at most this many times :attr:`Chaos.requests` requests (a bound, should
the restarted sidecar never serve). While no sidecar answers, a request is a miss in well
under a millisecond, and a sidecar restarting on a loaded machine (torch imports) can take
seconds: 20 times was once spent before the new one answered."""


def serve_command() -> list[str]:
    """``lmcache-async`` as installed next to this interpreter (else ``-m``)."""
    script = Path(sys.executable).with_name("lmcache-async")
    return [str(script)] if script.exists() else [sys.executable, "-m", "lmcache_async.cli"]


@dataclass
class SidecarProcess:
    """``lmcache-async serve`` processes on one socket, one after the other: each
    :meth:`start` launches a new one (logging to its own file) once the last is gone."""

    url: str
    args: list[str]
    log_dir: Path
    process: subprocess.Popen[bytes] | None = None
    logs: list[Path] = field(default_factory=list)
    _log_file: IO[bytes] | None = field(default=None, repr=False)

    def start(self) -> None:
        if self.process is not None and self.process.poll() is None:
            raise RuntimeError("the sidecar is still running")
        self._close_log()
        path = self.log_dir / f"sidecar-{len(self.logs)}.log"
        self.logs.append(path)
        self._log_file = path.open("wb")
        self.process = subprocess.Popen(
            [*serve_command(), "serve", "--listen", self.url, *self.args],
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
        )

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def crash_and_restart(self) -> None:
        """SIGKILL the running sidecar and start a new one on the same socket."""
        self.kill()
        self.start()

    def kill(self) -> None:
        """SIGKILL, as a crash, and reap it."""
        if self.process is not None and self.alive():
            self.process.send_signal(signal.SIGKILL)
        if self.process is not None:
            self.process.wait(timeout=STOP_TIMEOUT)

    def stop(self) -> int | None:
        """SIGTERM and wait (SIGKILL if it does not exit); returns the exit status."""
        process = self.process
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=STOP_TIMEOUT)
        self._close_log()
        return None if process is None else process.returncode

    def _close_log(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def log(self) -> str:
        return "".join(self.each_log())

    def each_log(self) -> list[str]:
        """The log of each sidecar started, in order."""
        return [path.read_text(errors="replace") for path in self.logs]

    async def wait_ready(self) -> None:
        """PING until the sidecar answers (bounded; no fixed sleep)."""
        with anyio.fail_after(READY_TIMEOUT):
            while not await ping(self.url, 0.5):
                if not self.alive():
                    raise RuntimeError(f"the sidecar exited early:\n{self.log()[-4000:]}")


@dataclass(frozen=True, slots=True)
class Chaos:
    """When the faults come, in requests ended since the previous stage was carried out:
    Redis is SIGKILLed after ``kill_redis`` requests, restarted after ``restart_redis``
    more, and the sidecar SIGKILLed after ``kill_sidecar`` more (and started again at
    once); the run then goes on until the new sidecar has served ``after`` requests (the
    calls made while it starts are misses and do not count)."""

    kill_redis: int = 20
    restart_redis: int = 20
    kill_sidecar: int = 20
    after: int = 40

    @property
    def requests(self) -> int:
        """The requests the stages need at least (more end: those in flight at each stage,
        the misses while the sidecar starts)."""
        return self.kill_redis + self.restart_redis + self.kill_sidecar + self.after


@dataclass(slots=True)
class ChaosResult:
    """The load run's results, when each stage was carried out (``(stage, requests ended,
    seconds into the run)``), and the log of each sidecar started."""

    results: dict[str, Any]
    stages: list[tuple[str, int, float]]
    sidecar_logs: list[str]
    first_stats: dict[str, Any]
    """The first sidecar's engine stats just before it was killed (empty: no answer)."""

    @property
    def sidecar_log(self) -> str:
        return "".join(self.sidecar_logs)


def figures(result: ChaosResult) -> str:
    """The figures to quote: longest waits, p50/p99, errors, verified, and the stages."""
    res = result.results
    lines = [
        f"requests {res['requests']}, retrieves {res['retrieves']} "
        f"({res['retrieve_short']} short), stores {res['stores']} "
        f"({res['partial_stores']} partial), hit rate {res['hit_rate']:.1%}",
        f"errors {res['errors_total']} {dict(res['errors'])}, verified "
        f"{res['verified_retrieves']} of {res['retrieves']} retrieves bit-exact, "
        f"{res['verify_failures']} mismatched, "
        f"{res.get('unreachable_calls', 0)} calls while the sidecar was unreachable",
    ]
    for op in ("lookup", "retrieve", "store", "request"):
        stat = res["latency_ms"][op]
        lines.append(
            f"{op:>8}: p50 {stat['p50']:8.1f} ms  p99 {stat['p99']:8.1f} ms  "
            f"longest {stat.get('max', float('nan')):8.1f} ms  ({int(stat['count'])} calls)"
        )
    lines.append(
        "stages: " + ", ".join(f"{name} at {n} ({t:.1f} s)" for name, n, t in result.stages)
    )
    first = result.first_stats
    if first:
        lines.append(
            f"first sidecar before its kill: {first.get('evicted_chunks')} chunks evicted, "
            f"{first.get('partial_stores')} partial stores, "
            f"{first.get('promoted_chunks', '-')} chunks promoted from disk/Redis"
        )
    return "\n".join(lines)


@contextlib.asynccontextmanager
async def _redis(directory: Path) -> AsyncIterator[RedisServer]:
    server = await anyio.to_thread.run_sync(RedisServer(directory).start)
    try:
        yield server
    finally:
        await anyio.to_thread.run_sync(server.stop)


def _kill_redis(server: RedisServer) -> None:
    """SIGKILL; :meth:`RedisServer.restart` reaps it and starts it on the same port."""
    pid = server.pid
    if pid is not None:
        os.kill(pid, signal.SIGKILL)


async def chaos_run(
    options: LoadOptions,
    chaos: Chaos,
    *,
    workdir: Path,
    sidecar_flags: Sequence[str],
    on_stage: Callable[[str, int], None] | None = None,
) -> ChaosResult:
    """Run ``options`` (target ``sidecar``; its ``url`` and ``requests`` are set here)
    against a sidecar started with ``sidecar_flags`` plus a disk tier and a Redis tier
    under ``workdir``, carrying out ``chaos``.

    Raises:
        RuntimeError: a sidecar did not start, or a stage was never reached.
    """
    short = Path(tempfile.mkdtemp(prefix="lmc-chaos-", dir="/tmp"))  # ipc paths are short
    url = f"ipc://{short}/chaos.sock"
    stages: list[tuple[str, int, float]] = []
    plan = [
        ("kill_redis", chaos.kill_redis),
        ("restart_redis", chaos.restart_redis),
        ("kill_sidecar", chaos.kill_sidecar),
    ]
    progress = anyio.Event()  # set when a request ends
    ended = 0
    served_after = 0  # requests the restarted sidecar served (they stored or loaded)
    moved = 0
    began = time.perf_counter()

    def on_request(tally: Tally) -> bool:
        nonlocal ended, served_after, moved
        ended += 1
        progress.set()
        now = tally.tokens_stored + tally.tokens_loaded
        if len(stages) == len(plan) and now > moved:
            served_after += 1
        moved = now
        return served_after >= chaos.after

    try:
        async with _redis(workdir / "redis") as redis:
            flags = [
                *sidecar_flags,
                "--local-disk",
                str(workdir / "disk"),
                "--remote-url",
                redis.url,
            ]
            sidecar = SidecarProcess(url, flags, workdir)
            sidecar.start()
            try:
                await sidecar.wait_ready()
                actions: dict[str, Callable[[], None]] = {
                    "kill_redis": lambda: _kill_redis(redis),
                    "restart_redis": redis.restart,
                    "kill_sidecar": sidecar.crash_and_restart,
                }
                run_options = dataclasses.replace(
                    options, target="sidecar", url=url, requests=_MOST_REQUESTS * chaos.requests
                )
                results: dict[str, Any] = {}
                first_stats: dict[str, Any] = {}

                async def faults() -> None:
                    nonlocal progress
                    mark = 0  # requests ended when the last stage was carried out
                    for name, after in plan:
                        while ended - mark < after:
                            await progress.wait()
                            progress = anyio.Event()
                        if name == "kill_sidecar":
                            with (
                                contextlib.suppress(LMCacheAsyncError),
                                AdminClient(url, timeout=STATS_TIMEOUT) as admin,
                            ):
                                first_stats.update((await admin.stats()).get("stats") or {})
                        await anyio.to_thread.run_sync(actions[name])
                        mark = ended
                        stages.append((name, ended, time.perf_counter() - began))
                        if on_stage is not None:
                            on_stage(name, ended)

                async def load() -> None:
                    results.update(
                        await run_load_async(run_options, EngineConfig(), on_request=on_request)
                    )

                async with anyio.create_task_group() as tg:
                    tg.start_soon(faults)
                    await load()
                    tg.cancel_scope.cancel()
            finally:
                await anyio.to_thread.run_sync(sidecar.stop)
    finally:
        shutil.rmtree(short, ignore_errors=True)
    if len(stages) < len(plan) or served_after < chaos.after:
        raise RuntimeError(
            f"the run ended after {ended} requests, {served_after} served after the "
            f"restart, before every stage: {stages}"
        )
    return ChaosResult(results, stages, sidecar.each_log(), first_stats)


# -- the sizes ------------------------------------------------------------------------------

SMALL: Final = LoadOptions(
    workload="multi-round-chat",
    concurrency=4,
    duration=600.0,  # the run ends after Chaos.requests requests, not on a clock
    users=8,
    system_prompt_tokens=512,
    turn_tokens=192,
    max_context_tokens=4096,
    num_layers=4,
    num_kv_heads=4,
    head_size=64,
    verify_every=1,
    progress=False,
)
"""A small workload (4 KiB of KV a token, prompts of up to 16 MiB) for a 2-core machine."""

FULL: Final = dataclasses.replace(
    SMALL,
    system_prompt_tokens=1024,
    turn_tokens=384,
    max_context_tokens=8192,
    num_layers=16,
    num_kv_heads=8,
)
"""The issue's run: the load generator's default model (32 KiB a token, prompts up to
256 MiB) against a 0.3 GB CPU tier."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="the issue's sizes")
    parser.add_argument("--cpu-gb", type=float, default=None)
    parser.add_argument("--sidecar-timeout", type=float, default=None)
    parser.add_argument("--stage", type=int, default=None, help="requests per stage")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--keep", type=Path, default=None, help="keep the logs here")
    parser.add_argument("flags", nargs="*", help="more sidecar flags (after --)")
    args = parser.parse_args(argv)
    options = FULL if args.full else SMALL
    cpu_gb = args.cpu_gb if args.cpu_gb is not None else (0.3 if args.full else 0.03)
    if args.sidecar_timeout is not None:
        options = dataclasses.replace(options, sidecar_timeout=args.sidecar_timeout)
    chaos = Chaos()
    if args.stage is not None:
        chaos = Chaos(args.stage, args.stage, args.stage, 2 * args.stage)
    flags = ["--max-local-cpu-size", str(cpu_gb), "--heartbeat-interval", "0.5", *args.flags]
    workdir = Path(tempfile.mkdtemp(prefix="lmc-chaos-run-"))

    def say(name: str, ended: int) -> None:
        print(f"stage {name} after {ended} requests", file=sys.stderr)

    try:
        result = anyio.run(
            lambda: chaos_run(options, chaos, workdir=workdir, sidecar_flags=flags, on_stage=say)
        )
        print(format_summary(result.results))
        print()
        print(figures(result))
        if args.json is not None:
            args.json.write_text(json.dumps(result.results, default=str))
        if args.keep is not None:
            args.keep.mkdir(parents=True, exist_ok=True)
            (args.keep / "sidecar.log").write_text(result.sidecar_log)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
