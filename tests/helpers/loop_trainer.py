"""A trainer that publishes Linear(16, 8) on bus NAME in a loop until interrupted.

    python tests/helpers/loop_trainer.py NAME

Prints {"event": "ready"} once a worker applied a version, then {"event": "publishing",
"version": v} before each publish; a plain script: Ctrl-C (SIGINT) unwinds its `with`.
"""

from __future__ import annotations

import json
import sys

import torch

import zmqsync


def main() -> None:
    model = torch.nn.Linear(16, 8)
    with zmqsync.Publisher(model, name=sys.argv[1], timeout=60) as pub:
        if not pub.wait_for_workers(1, timeout=60):
            raise SystemExit("no worker")
        print(json.dumps({"event": "ready", "version": pub.version}), flush=True)
        while True:
            with torch.no_grad():
                model.weight.add_(1.0)
            print(json.dumps({"event": "publishing", "version": pub.version + 1}), flush=True)
            pub.publish()


if __name__ == "__main__":
    main()
