"""A HELLO storm against a bus on this host, to measure what admission costs honest joins.

Sends HELLOs as fast as the publisher answers them, on a few DEALER connections with a
few requests in flight on each, for one worker id (a live worker's: every HELLO is
refused as "in use") or for many (``--ids``: new ids, each one a handshake to pay for),
and counts the answers by kind. Bounded in time, count and connections, and only ever
aimed at this host (ipc:// or loopback tcp://)::

    python tools/hello_storm.py --name NAME --worker-id victim --seconds 10
    python tools/hello_storm.py --name NAME --ids 2000 --seconds 10

Prints ``{"event": "storming"}`` once the first answer is in, and at the end (deadline,
``--max-hellos`` or SIGTERM) ``{"event": "done", "sent", "answered", "answers", "seconds",
"rate"}`` where ``answers`` counts "welcome" and each refusal by its first word.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections import Counter

import zmq

from zmqsync._config import default_address
from zmqsync._protocol import Error, Hello, decode, encode
from zmqsync._security import is_loopback

MAX_SECONDS = 120.0
MAX_HELLOS = 10_000_000
MAX_CONNECTIONS = 16
MAX_WINDOW = 16  # the control socket queues 16 requests per connection


def _kind(frame: bytes) -> str:
    """The kind of a reply: "welcome", or an ERROR's reason up to its first colon."""
    try:
        reply = decode(frame)
    except Exception:  # noqa: BLE001 - a tool: count what it cannot read
        return "invalid"
    if isinstance(reply, Error):
        return reply.reason.split(":", 1)[0][:32]
    return reply.TYPE


def storm(
    address: str, ids: list[str], *, seconds: float, max_hellos: int, connections: int, window: int
) -> dict[str, object]:
    """Send HELLOs for `ids` (round robin) until the deadline or `max_hellos`."""
    if not is_loopback(address):
        raise SystemExit(f"refusing {address}: this tool only aims at ipc:// or loopback tcp://")
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    frames = [encode(Hello("", w, os.getpid(), "storm", "copy", "cpu")) for w in ids]
    ctx = zmq.Context()
    socks = []
    for _ in range(connections):
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(address)
        socks.append(sock)
    poller = zmq.Poller()
    for sock in socks:
        poller.register(sock, zmq.POLLIN)
    answers: Counter[str] = Counter()
    in_flight = dict.fromkeys(socks, 0)
    sent = answered = 0
    t0 = time.monotonic()
    end = t0 + seconds
    announced = False
    try:
        while not stop["now"] and time.monotonic() < end:
            for sock in socks:
                while in_flight[sock] < window and sent < max_hellos:
                    sock.send_multipart([b"", frames[sent % len(frames)]], zmq.NOBLOCK)
                    in_flight[sock] += 1
                    sent += 1
            for sock, _ in poller.poll(100):
                while sock.poll(0):
                    parts = sock.recv_multipart()
                    in_flight[sock] -= 1
                    answered += 1
                    answers[_kind(parts[-1])] += 1
            if answered and not announced:
                print(json.dumps({"event": "storming", "address": address}), flush=True)
                announced = True
            if sent >= max_hellos and not any(in_flight.values()):
                break
    finally:
        ctx.destroy(linger=0)
    took = time.monotonic() - t0
    return {
        "event": "done",
        "sent": sent,
        "answered": answered,
        "answers": dict(answers),
        "seconds": round(took, 3),
        "rate": round(answered / took, 1) if took else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--address", default=None, help="control address (default: the --name bus's)")
    p.add_argument("--name", default="weights")
    p.add_argument("--worker-id", default="victim", help="the one id every HELLO names")
    p.add_argument("--ids", type=int, default=0, help="instead: this many ids storm-0..N-1")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--max-hellos", type=int, default=MAX_HELLOS)
    p.add_argument("--connections", type=int, default=4)
    p.add_argument("--window", type=int, default=8)
    args = p.parse_args(argv)
    address = args.address or default_address(args.name)
    ids = [f"storm-{i}" for i in range(min(args.ids, 100_000))] or [args.worker_id]
    report = storm(
        address,
        ids,
        seconds=min(max(args.seconds, 0.0), MAX_SECONDS),
        max_hellos=min(max(args.max_hellos, 1), MAX_HELLOS),
        connections=min(max(args.connections, 1), MAX_CONNECTIONS),
        window=min(max(args.window, 1), MAX_WINDOW),
    )
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
