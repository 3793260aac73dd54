"""A connection storm against a bus's socket on this host, bounded in count and time.

    python tools/connect_storm.py ENDPOINT [--mode raw|zmtp|hold] [--seconds 10]
                                  [--count N] [--hold N] [--procs P] [--join CONTROL]

Modes, each a loop in one process (or `--procs` of them):

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
peer the publisher holds to a worker's allowance, not a stranger's.

Only loopback is ever a target: ipc://, or tcp:// on 127.0.0.0/8, ::1 or localhost.
Prints one JSON line at the end: connections made, seconds, rate, errors.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import multiprocessing
import signal
import socket
import sys
import time

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
    import os

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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("endpoint", help="ipc://PATH or tcp://LOOPBACK:PORT")
    p.add_argument("--mode", choices=("raw", "zmtp", "hold"), default="raw")
    p.add_argument("--seconds", type=float, default=10.0, help="at most this long (<= 600)")
    p.add_argument("--count", type=int, default=10_000_000, help="at most this many connections")
    p.add_argument("--hold", type=int, default=1000, help="hold: connections kept open")
    p.add_argument("--procs", type=int, default=1, help="processes, each its own storm")
    p.add_argument("--join", default=None, help="join the bus at this control address first")
    args = p.parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
