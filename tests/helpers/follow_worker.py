"""A plain worker process, as a user writes one: alias mode, background apply, the main
thread waiting for each next version. Prints what every version it saw holds (the sum
of its weights) and, once the bus closes, its counters."""

import json
import sys

import torch

import zmqsync


def main() -> int:
    name = sys.argv[1]
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
    with zmqsync.Subscriber(name=name, model=model, reads=zmqsync.Aliases(), timeout=30) as sub:
        print(json.dumps({"event": "ready", "version": sub.version}), flush=True)
        # The next version after the last one *reported*, not after `sub.version`: a
        # version applied just as a wait timed out would otherwise never be reported.
        reported = sub.version
        while not sub.stopped:
            if sub.wait_for_version(reported + 1, timeout=1.0):
                with torch.no_grad():
                    total = float(sum(p.sum() for p in model.parameters()))
                reported = sub.version
                print(json.dumps({"event": "seen", "version": reported, "sum": total}), flush=True)
        print(json.dumps({"event": "done", "counters": sub.counters}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
