"""A publisher under attack, for the hardening tests: capped, observed, publishing on.

    python tests/helpers/victim.py NAME --data-mb 1024 [--address tcp://127.0.0.1:0]

Caps its own data segment (RLIMIT_DATA, which counts the heap and anonymous mappings)
before importing anything big, so a flood that makes it allocate kills this process,
never the machine. Prints JSON lines: "started" (pid, address, bus), one "published" per
publish (seconds, acked), and on SIGTERM "done" with its counters and peak RSS. It
publishes every --interval seconds; a PublishTimeout is reported, not raised.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import sys
import threading
import time


def _peak_rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return -1.0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("name")
    p.add_argument("--address", default=None)
    p.add_argument("--data-mb", type=int, default=1024)
    p.add_argument("--nofile", type=int, nargs=2, default=None, metavar=("SOFT", "HARD"))
    p.add_argument("--interval", type=float, default=0.05)
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--heartbeat", type=float, default=0.5)
    p.add_argument("--max-workers", type=int, default=1024)
    p.add_argument("--max-workers-per-peer", type=int, default=None)
    p.add_argument("--handshake-rate", type=float, default=200.0)
    p.add_argument("--tap", action="store_true")
    p.add_argument("--curve", action="store_true", help="curve=True (keys in the runtime dir)")
    p.add_argument("--no-publish", action="store_true")
    args = p.parse_args()
    cap = args.data_mb * 2**20
    resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
    if args.nofile:
        resource.setrlimit(resource.RLIMIT_NOFILE, tuple(args.nofile))

    import torch

    import zmqsync

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    pub = zmqsync.Publisher(
        {"w": torch.zeros(1024)},
        args.address,
        name=args.name,
        timeout=args.timeout,
        on_timeout="raise",
        heartbeat=args.heartbeat,
        security=zmqsync.Security(
            curve=True if args.curve else None,
            insecure=True,
            tap=args.tap,
            max_workers=args.max_workers,
            max_workers_per_peer=args.max_workers_per_peer,
            handshake_rate=args.handshake_rate,
        ),
    )
    with pub:
        limit = resource.getrlimit(resource.RLIMIT_NOFILE)
        record = {"event": "started", "pid": os.getpid(), "address": pub.address, "bus": pub.bus_id}
        print(json.dumps({**record, "nofile": list(limit)}), flush=True)
        version = 0
        while not stop.wait(args.interval):
            if args.no_publish:
                continue
            version += 1
            t0 = time.monotonic()
            try:
                handle = pub.publish(weights={"w": torch.full((1024,), float(version))})
                record = {"event": "published", "version": version, "acked": list(handle.acked)}
            except zmqsync.PublishTimeout as exc:
                record = {"event": "timeout", "version": version, "missing": list(exc.missing)}
            record["seconds"] = time.monotonic() - t0
            print(json.dumps(record), flush=True)
        done = {"event": "done", "counters": pub.counters, "peak_rss_mb": _peak_rss_mb()}
        print(json.dumps(done), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
