"""A worker that times its own join, for the storm tests and tools/bench/joins/storm.py.

    python tests/helpers/joiner.py ADDRESS --go FILE [--name NAME] [--timeout 10]

Imports first and says "ready", then waits until FILE exists: the join is timed from
then, so the measure is the handshake (HELLO, WELCOME, the events subscription and the
acks connection), not Python's start. Prints JSON lines: "joined" (seconds),
then "heard" once it applied `--versions` more versions than it joined at (proof it is
not deaf), or "timeout" / "deaf" with what it got.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("address")
    p.add_argument("--name", default="weights")
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--versions", type=int, default=2)
    p.add_argument("--go", required=True, help="start joining once this file exists")
    args = p.parse_args()

    import zmqsync

    # made before the start signal: its first construction imports what it needs
    sub = zmqsync.Subscriber(args.address, name=args.name, timeout=args.timeout)
    print(json.dumps({"event": "ready"}), flush=True)
    while not os.path.exists(args.go):
        time.sleep(0.001)
    start = time.monotonic()
    try:
        sub.start()
    except zmqsync.ConnectTimeout as exc:
        record = {"event": "timeout", "seconds": time.monotonic() - start, "error": str(exc)}
        print(json.dumps(record), flush=True)
        return 1
    with sub:
        joined, version = time.monotonic() - start, sub.version
        print(json.dumps({"event": "joined", "seconds": joined, "version": version}), flush=True)
        if sub.wait_for_version(version + args.versions, timeout=args.timeout):
            record = {"event": "heard", "seconds": time.monotonic() - start}
        else:
            record = {"event": "deaf", "version": sub.version, "joined_at": version}
        print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
