"""The storms: a peer that floods a bus on this host, bounded in count and time.

Every scenario that asks what a storm does to honest joins or publishes (joins, the
admission figures) and the tests start this one script. What it aims at decides the
storm: a socket's endpoint gets a connection storm, a bus (by name or control address)
gets a HELLO storm::

    python tools/bench/storms.py ENDPOINT [--mode raw|zmtp|hold] [--seconds 10]
                                 [--count N] [--hold N] [--procs P] [--join CONTROL]
    python tools/bench/storms.py --name NAME [--address CONTROL] --worker-id victim
                                 [--ids N] [--seconds 10] [--connections 4] [--window 8]

Connection storms, each a loop in one process (or `--procs` of them):

* ``raw``: connect() and close(), as fast as the kernel takes them; no ZMTP at all (the
  cheapest storm: ~33k/s over ipc on one core). Over tcp the close resets the
  connection (SO_LINGER 0) so that ports in TIME_WAIT do not end the storm.
* ``zmtp``: a NULL ZMTP greeting and READY as a SUB, then wait for the publisher's
  answer (READY, or ERROR when it refuses) and close: every connection reaches the
  handshake, so a ZAP handler is asked about each one.
* ``hold``: keep up to `--hold` connections open (greeted, then silent), opening a new one
  whenever one is dropped.

``--join CONTROL`` first joins the bus at that control address as a worker (one HELLO,
welcomed, never a word after it), so that the storm comes from a *member*'s process: a
peer the publisher holds to a worker's allowance, not a stranger's. Prints one JSON line
at the end: connections made, seconds, rate, errors.

The HELLO storm sends HELLOs as fast as the publisher answers them, on a few DEALER
connections with a few requests in flight on each, for one worker id (a live worker's:
every HELLO is refused as "in use") or for many (``--ids``: new ids, each one a
handshake to pay for), and counts the answers by kind. It prints ``{"event":
"storming"}`` once the first answer is in, and at the end (deadline, ``--max-hellos`` or
SIGTERM) ``{"event": "done", "sent", "answered", "answers", "seconds", "rate"}`` where
``answers`` counts "welcome" and each refusal by its first word.

Only loopback is ever a target: ipc://, or tcp:// on 127.0.0.0/8, ::1 or localhost.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import multiprocessing
import os
import signal
import socket
import sys
import time
from collections import Counter

_GREETING = b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\x00") + bytes(32)
_READY = b"\x05READY" + b"\x0bSocket-Type" + (3).to_bytes(4, "big") + b"SUB"
_HELLO = _GREETING + bytes([0x04, len(_READY)]) + _READY
_LINGER_RESET = (1).to_bytes(4, "little") + (0).to_bytes(4, "little")  # struct linger {1, 0}


def _target(endpoint: str) -> tuple[int, object]:
    """(address family, address) of a loopback endpoint; anything else is refused."""
    if endpoint.startswith("ipc://"):
        return socket.AF_UNIX, endpoint[len("ipc://") :]
    if endpoint.startswith("tcp://"):
        host, port = endpoint[len("tcp://") :].rsplit(":", 1)
        host = host.strip("[]")
        if host == "localhost":
            host = "127.0.0.1"
        if ipaddress.ip_address(host).is_loopback and port.isdigit():
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            return family, (host, int(port))
    raise SystemExit(f"{endpoint!r}: only ipc:// and loopback tcp:// endpoints are targets")


def _open(family: int, address: object) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    if family != socket.AF_UNIX:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
    sock.settimeout(2.0)
    sock.connect(address)  # type: ignore[arg-type]
    return sock


def _greet(sock: socket.socket) -> None:
    """Send a greeting and READY, then read what the publisher answers (its greeting,
    then READY or ERROR); a drop ends it early."""
    sock.sendall(_HELLO)
    got = 0
    while got < 64 + 2:
        chunk = sock.recv(4096)
        if not chunk:
            return
        got += len(chunk)


_stopped: list[bool] = []  # SIGTERM: end the storm and report, as at its deadline


def _storm(endpoint: str, mode: str, seconds: float, count: int, hold: int) -> dict[str, float]:
    family, address = _target(endpoint)
    made = errors = 0
    held: list[socket.socket] = []
    start = time.monotonic()
    end = start + seconds
    while made < count and time.monotonic() < end and not _stopped:
        try:
            if mode == "hold":
                for sock in list(held):  # drop what the publisher shut down
                    try:
                        if sock.recv(4096, socket.MSG_DONTWAIT) == b"":
                            held.remove(sock)
                            sock.close()
                    except BlockingIOError:
                        pass
                if len(held) >= hold:
                    time.sleep(0.01)
                    continue
                sock = _open(family, address)
                sock.sendall(_HELLO)
                held.append(sock)
            else:
                with _open(family, address) as sock:
                    if mode == "zmtp":
                        _greet(sock)
            made += 1
        except OSError:
            errors += 1
    for sock in held:
        sock.close()
    elapsed = time.monotonic() - start
    return {"connections": made, "errors": errors, "seconds": elapsed}


def _join(control: str) -> None:
    """One HELLO as a worker of this process, welcomed: the storm's peer is a member."""
    import zmq

    from zmqsync._deadline import Deadline
    from zmqsync._protocol import Hello, Welcome
    from zmqsync._sockets import request

    with zmq.Context() as ctx:
        hello = Hello("", f"storm-{os.getpid()}", os.getpid(), "storm", "copy", "cpu")
        reply = request(ctx, control, hello, deadline=Deadline(30.0))
    if not isinstance(reply, Welcome):
        raise SystemExit(f"not welcomed: {reply!r}")
    print(json.dumps({"event": "joined", "pid": os.getpid()}), flush=True)


def _run(args: argparse.Namespace) -> dict[str, float]:
    return _storm(args.endpoint, args.mode, args.seconds, args.count, args.hold)


# --- the HELLO storm ------------------------------------------------------------

MAX_SECONDS = 120.0
MAX_HELLOS = 10_000_000
MAX_CONNECTIONS = 16
MAX_WINDOW = 16  # the control socket queues 16 requests per connection


def _kind(frame: bytes) -> str:
    """The kind of a reply: "welcome", or an ERROR's reason up to its first colon."""
    from zmqsync._protocol import Error, decode

    try:
        reply = decode(frame)
    except Exception:  # noqa: BLE001 - a tool: count what it cannot read
        return "invalid"
    if isinstance(reply, Error):
        return reply.reason.split(":", 1)[0][:32]
    return reply.TYPE


def hello_storm(
    address: str, ids: list[str], *, seconds: float, max_hellos: int, connections: int, window: int
) -> dict[str, object]:
    """Send HELLOs for `ids` (round robin) until the deadline or `max_hellos`."""
    import zmq

    from zmqsync._protocol import Hello, encode
    from zmqsync._security import is_loopback

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
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "endpoint", nargs="?", help="a connection storm: ipc://PATH or tcp://LOOPBACK:PORT"
    )
    p.add_argument("--mode", choices=("raw", "zmtp", "hold"), default="raw")
    p.add_argument("--seconds", type=float, default=10.0, help="at most this long (<= 600)")
    p.add_argument("--count", type=int, default=10_000_000, help="at most this many connections")
    p.add_argument("--hold", type=int, default=1000, help="hold: connections kept open")
    p.add_argument("--procs", type=int, default=1, help="processes, each its own storm")
    p.add_argument("--join", default=None, help="join the bus at this control address first")
    hello = p.add_argument_group("a HELLO storm (no ENDPOINT)")
    hello.add_argument(
        "--address", default=None, help="control address (default: the --name bus's)"
    )
    hello.add_argument("--name", default="weights")
    hello.add_argument("--worker-id", default="victim", help="the one id every HELLO names")
    hello.add_argument("--ids", type=int, default=0, help="instead: this many ids storm-0..N-1")
    hello.add_argument("--max-hellos", type=int, default=MAX_HELLOS)
    hello.add_argument("--connections", type=int, default=4)
    hello.add_argument("--window", type=int, default=8)
    args = p.parse_args(argv)
    if args.endpoint is None:
        return _hello_main(args)
    _target(args.endpoint)
    if args.join is not None:
        if args.procs != 1:
            p.error("--join storms from the joined process itself: --procs 1")
        _target(args.join)
        _join(args.join)
    signal.signal(signal.SIGTERM, lambda *_: _stopped.append(True))
    args.seconds = min(max(args.seconds, 0.0), 600.0)
    if args.procs > 1:
        with multiprocessing.Pool(min(args.procs, 64)) as pool:
            results = pool.map(_run, [args] * args.procs)
    else:
        results = [_run(args)]
    made = sum(r["connections"] for r in results)
    seconds = max(r["seconds"] for r in results)
    summary = {
        "endpoint": args.endpoint,
        "mode": args.mode,
        "procs": args.procs,
        "connections": made,
        "errors": sum(r["errors"] for r in results),
        "seconds": round(seconds, 3),
        "rate": round(made / seconds) if seconds > 0 else 0,
    }
    print(json.dumps(summary), flush=True)
    return 0


def _hello_main(args: argparse.Namespace) -> int:
    from zmqsync._config import default_address

    address = args.address or default_address(args.name)
    ids = [f"storm-{i}" for i in range(min(args.ids, 100_000))] or [args.worker_id]
    report = hello_storm(
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
