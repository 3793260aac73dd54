"""A publisher process of many small tensors, for tests that stop, starve or storm it.

    python tests/helpers/bus_publisher.py NAME --tensors 2000 --heartbeat 0.5 --interval 0

Prints {"event": "started", "pid"} once version 0 is out, then publishes a new version
every --interval seconds (0: never; a publish waits for the workers' acks and prints
{"event": "published", "version", "acked", "missing"}), until SIGTERM, then closes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading

import torch

import zmqsync


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("name")
    p.add_argument("--tensors", type=int, default=1)
    p.add_argument("--heartbeat", type=float, default=0.5)
    p.add_argument("--interval", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=10.0)
    args = p.parse_args()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    weights = {f"t{i}": torch.zeros(4) for i in range(args.tensors)}
    with zmqsync.Publisher(
        weights,
        name=args.name,
        heartbeat=args.heartbeat,
        timeout=args.timeout,
        on_timeout="evict",
    ) as pub:
        print(json.dumps({"event": "started", "pid": os.getpid()}), flush=True)
        while not stop.wait(args.interval or None):
            handle = pub.publish()
            record = {
                "event": "published",
                "version": handle.version,
                "acked": list(handle.acked),
                "missing": list(handle.missing),
            }
            print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
