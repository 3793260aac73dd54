"""A rollout worker of a given speed: it applies the newest version at the start of
each rollout (apply="manual", the safe point) and then computes for `--step` seconds.

    python tests/helpers/paced_worker.py NAME WORKER_ID --step 0.05 [--mode copy]

Prints {"event": "joined", "version", "t"} once started, then {"event": "applied",
"version", "t"} for each version it computes with, where `t` is ``time.monotonic()``
taken in `on_update`, before its ack is sent (CLOCK_MONOTONIC is one clock for every
process of the host, so a test compares it with the moment a publish returned). On
SIGTERM it closes and exits.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time

import zmqsync


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("name")
    p.add_argument("worker_id")
    p.add_argument("--step", type=float, default=0.0, help="seconds per rollout")
    p.add_argument("--mode", default="copy")
    p.add_argument("--timeout", type=float, default=60.0)
    args = p.parse_args()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())

    def applied(version: int) -> None:
        record = {"event": "applied", "version": version, "t": time.monotonic()}
        print(json.dumps(record), flush=True)

    with zmqsync.Subscriber(
        name=args.name,
        worker_id=args.worker_id,
        mode=args.mode,
        apply="manual",
        timeout=args.timeout,
        on_update=applied,
    ) as sub:
        print(json.dumps({"event": "joined", "version": sub.version}), flush=True)
        while not stop.is_set():
            sub.poll()  # the safe point: the newest version, if one arrived
            stop.wait(args.step)  # the rollout (or an idle wait for the next version)
    return 0


if __name__ == "__main__":
    sys.exit(main())
