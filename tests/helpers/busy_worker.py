"""A worker whose main thread computes in Python all the time, as an RL collector's
rollout loop does: the subscriber's agent thread competes with it for the GIL.

    python tests/helpers/busy_worker.py NAME WORKER_ID [--mode alias] [--timeout 60]

Prints {"event": "joined", "version"} once started, then {"event": "applied", "version"}
for each version it computes with (from `on_update`), until SIGTERM; then closes.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading

import zmqsync


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("name")
    p.add_argument("worker_id")
    p.add_argument("--mode", default="alias")
    p.add_argument("--timeout", type=float, default=60.0)
    args = p.parse_args()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    lock = threading.Lock()

    def applied(version: int) -> None:
        with lock:
            print(json.dumps({"event": "applied", "version": version}), flush=True)

    with zmqsync.Subscriber(
        name=args.name,
        worker_id=args.worker_id,
        reads=(
            zmqsync.Aliases(on_update=applied)
            if args.mode == "alias"
            else zmqsync.Copies(on_update=applied)
        ),
        timeout=args.timeout,
    ) as sub:
        with lock:
            print(json.dumps({"event": "joined", "version": sub.version}), flush=True)
        total = 0
        while not stop.is_set():  # the "rollout": pure Python, never sleeps
            for i in range(10_000):
                total += i * i % 7
    return 0


if __name__ == "__main__":
    sys.exit(main())
