"""A trainer that publishes version 0 of the tiny Llama and waits to be killed.

``python -m tests.helpers.vllm_trainer NAME SEED``: prints the bus's control address on
one line, then sleeps (at most 10 minutes) until the test kills it.
"""

from __future__ import annotations

import sys
import time

import zmqsync
from tests.helpers.vllm_model import state_dict


def main(name: str, seed: int) -> int:
    with zmqsync.Publisher(state_dict(seed), name=name) as pub:
        print(pub.address, flush=True)
        time.sleep(600)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
