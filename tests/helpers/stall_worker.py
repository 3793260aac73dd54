"""A worker whose model may differ from the trainer's in dtype: one JSON line per applied
version with the digest of what it computes with, taken before the ack.

    python tests/helpers/stall_worker.py NAME MODE MODEL WORKER_ID

MODEL: "none" (the tensors as the bus lays them out), "mixed" (tests' `Mixed`), or
"mixed-bf16" (`Mixed` with its floating tensors in bfloat16).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout, for tests.

import zmqsync  # noqa: E402
from tests.helpers.models import Mixed  # noqa: E402
from zmqsync._checksum import digest  # noqa: E402
from zmqsync._layout import flatten  # noqa: E402


def main() -> int:
    name, mode, kind, worker_id = sys.argv[1:5]
    model: torch.nn.Module | None = None
    if kind.startswith("mixed"):
        model = Mixed().to(torch.bfloat16) if kind == "mixed-bf16" else Mixed()
    last = [-1]
    printing = threading.Lock()  # the agent's on_update and the main thread both report

    def report(version: int) -> None:
        flat = flatten(model) if model is not None else dict(sub.tensors)
        line = {"event": "applied", "version": version, "checksum": digest(flat)}
        with printing:
            print(json.dumps(line), flush=True)
        last[0] = version

    sub = zmqsync.Subscriber(
        name=name,
        model=model,
        reads=(
            zmqsync.Aliases(on_update=lambda version: report(version))
            if mode == "alias"
            else zmqsync.Copies(on_update=lambda version: report(version))
        ),
        timeout=60,
        worker_id=worker_id,
    )
    with sub:
        # on_update reported the version applied at the join already: reporting it again
        # from this thread could hash the tensors while the agent applies the next
        # version into them (a torn digest of a version that was whole)
        if last[0] < 0:
            report(sub.version)
        while not sub.stopped:
            time.sleep(0.05)
    print(json.dumps({"event": "summary", "last_version": last[0]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
