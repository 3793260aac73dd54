"""A worker whose model is Linear(IN, 8): joins bus NAME, reports on stdout as JSON.

    python tests/helpers/shaped_worker.py NAME IN [BUSY_S]

Prints {"event": "mismatch"} and exits 3 when its model does not match the bus
(LayoutMismatch); else {"event": "joined"}, {"event": "busy", "version": v} as each
version's `on_update` starts (which then sleeps BUSY_S), and {"event": "stopped", "ts":
time.time()} as soon as `sub.stopped` is True (looked at every 10 ms by the main thread),
then exits 0.
"""

from __future__ import annotations

import json
import sys
import time

import torch

import zmqsync


def say(**record: object) -> None:
    print(json.dumps(record), flush=True)


def main() -> int:
    name, size = sys.argv[1], int(sys.argv[2])
    busy = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0

    def on_update(version: int) -> None:
        say(event="busy", version=version, ts=time.time())
        time.sleep(busy)

    model = torch.nn.Linear(size, 8)
    try:
        sub = zmqsync.Subscriber(
            name=name, model=model, timeout=60, reads=zmqsync.Copies(on_update=on_update)
        )
        sub.start()
    except zmqsync.LayoutMismatch as exc:
        say(event="mismatch", reason=str(exc))
        return 3
    with sub:
        say(event="joined", version=sub.version)
        while not sub.stopped:
            time.sleep(0.01)
        say(event="stopped", ts=time.time(), connected=sub.connected)
    return 0


if __name__ == "__main__":
    sys.exit(main())
