"""A trainer that publishes when told to, for the metrics tests.

    python tests/helpers/metrics_trainer.py NAME --heartbeat 2 --timeout 1

Prints {"event": "started", "pid", "bus"} once version 0 is out. Each SIGUSR1 makes one
publish (waiting for every worker's ack, on_timeout="raise"), which prints
{"event": "published", "version", "acked"} or, past the deadline,
{"event": "timeout", "version", "missing"}. SIGTERM closes the publisher and exits.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import sys
import threading

import torch

import zmqsync


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("name")
    p.add_argument("--heartbeat", type=float, default=2.0)
    p.add_argument("--timeout", type=float, default=1.0)
    args = p.parse_args()
    stop = threading.Event()
    asked: queue.SimpleQueue[int] = queue.SimpleQueue()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGUSR1, lambda *_: asked.put(1))
    weights = {"w": torch.zeros(256), "b": torch.zeros(4)}
    with zmqsync.Publisher(
        weights, name=args.name, heartbeat=args.heartbeat, timeout=args.timeout
    ) as pub:
        print(json.dumps({"event": "started", "pid": os.getpid(), "bus": pub.bus_id}), flush=True)
        while not stop.is_set():
            try:
                asked.get(timeout=0.1)
            except queue.Empty:
                continue
            weights["w"] += 1
            try:
                handle = pub.publish()
            except zmqsync.PublishTimeout as exc:
                record = {"event": "timeout", "version": exc.version, "missing": list(exc.missing)}
            else:
                record = {"event": "published", "version": handle.version, "acked": handle.acked}
            print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
