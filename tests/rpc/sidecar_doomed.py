"""A client that dies in the middle of a store, for the sidecar tests.

It speaks the wire protocol by hand (msgpack and ZeroMQ only, so it starts fast): HELLO,
a pinned LOOKUP, a STORE; right after the server's allocation reply, before any COMMIT,
it prints ``ALLOCATED <chunks> PINNED <tokens>`` and SIGKILLs itself, leaving its
allocations and pins in the server for the session timeout to release.

Usage: ``sidecar_doomed.py URL NUM_TOKENS SALT``. The layout, model and prompt are those of
sidecar_client.py.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import msgpack
import zmq

PROTOCOL_VERSION = 2  # lmcache_async.rpc.protocol.PROTOCOL_VERSION
HELLO, LOOKUP, STORE, ERROR = 1, 2, 3, 0
LAYOUT = {
    "kind": "vllm_flash_attn",
    "num_layers": 2,
    "block_size": 16,
    "num_kv_heads": 2,
    "head_size": 16,
    "dtype": "float16",
}
MODEL = "sidecar-test"


def prompt(length: int, salt: int) -> bytes:
    """sidecar_client.prompt as little-endian int32 bytes (the token payload frame)."""
    ids = [(i * 7919 + 13 + salt) % 50_000 for i in range(length)]
    return b"".join(i.to_bytes(4, "little") for i in ids)


def main() -> None:
    url, num_tokens, salt = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    context: zmq.Context[zmq.Socket[Any]] = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 20_000)
    sock.connect(url)
    ids = iter(range(1, 100))

    def ask(msg_type: int, header: dict[str, Any], *payloads: bytes) -> dict[str, Any]:
        fields = {"v": PROTOCOL_VERSION, "id": next(ids), **header}
        if payloads:
            fields["sizes"] = [len(p) for p in payloads]
        sock.send_multipart([bytes([msg_type]), msgpack.packb(fields), *payloads])
        frames = sock.recv_multipart()
        reply: dict[str, Any] = msgpack.unpackb(frames[1])
        if frames[0][0] != msg_type:
            raise SystemExit(f"request {msg_type} failed: {reply}")
        return reply

    ask(HELLO, {"model_name": MODEL, "layout": LAYOUT, "client": "doomed"})
    tokens = prompt(num_tokens, salt)
    pinned = ask(LOOKUP, {"pin": True, "lookup_id": "doomed"}, tokens)["hits"]
    chunks = ask(STORE, {"start": 0}, tokens).get("chunks", [])
    print("ALLOCATED", len(chunks), "PINNED", pinned, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
