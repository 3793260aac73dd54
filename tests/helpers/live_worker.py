"""Alias worker of a live bus: reports what its weights hold, as they change.

Prints one JSON line whenever the value it reads (tensor "w", element 0) or the version
it applied changes, so a test sees an in-place write of the trainer's arrive without a
publish, and a publish arrive as a version.
"""

import json
import sys
import time

import zmqsync


def main() -> int:
    name = sys.argv[1]
    last = None
    with zmqsync.Subscriber(name=name, reads=zmqsync.Aliases(), timeout=30) as sub:
        print(json.dumps({"event": "ready", "version": sub.version}), flush=True)
        while not sub.stopped:
            now = (sub.version, float(sub.tensors[("w",)][0]))
            if now != last:
                last = now
                print(json.dumps({"event": "seen", "version": now[0], "value": now[1]}), flush=True)
            time.sleep(0.005)
    return 0


if __name__ == "__main__":
    sys.exit(main())
