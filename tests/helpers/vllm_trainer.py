"""A trainer of the tiny Llama in a process of its own, for tests that kill it.

``python -m tests.helpers.vllm_trainer NAME SEED [ADDRESS]``: publishes version 0 (the
weights of SEED), prints the bus's control address on one line, then for each stdin line
``SEED`` publishes those weights (without waiting for acks: the engine takes versions at
its own pace) and prints the version. It ends at EOF, or after 10 minutes.
"""

from __future__ import annotations

import select
import sys
import time

import zmqsync
from tests.helpers.vllm_model import state_dict


def main(name: str, seed: int, address: str | None) -> int:
    with zmqsync.Publisher(state_dict(seed), address, name=name) as pub:
        print(pub.address, flush=True)
        end = time.monotonic() + 600
        while time.monotonic() < end:
            ready, _, _ = select.select([sys.stdin], [], [], 1.0)
            if not ready:
                continue
            line = sys.stdin.readline()
            if not line:
                break
            p = pub.publish(weights=state_dict(int(line)), max_lag=None)
            print(p.version, flush=True)
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    sys.exit(main(args[0], int(args[1]), args[2] if len(args) > 2 else None))
