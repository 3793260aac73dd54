"""A copy-mode worker process without a model: prints the digest of every version it
applied (`zmqsync._checksum.digest`), so a trainer can compare each with its own."""

import json
import sys

import zmqsync
from zmqsync._checksum import digest
from zmqsync._layout import flatten


def main() -> int:
    name, mode = sys.argv[1], sys.argv[2]
    with zmqsync.Subscriber(
        name=name, reads=(zmqsync.Aliases() if mode == "alias" else zmqsync.Copies()), timeout=30
    ) as sub:
        print(json.dumps({"event": "ready", "version": sub.version}), flush=True)
        reported = sub.version
        while not sub.stopped:
            if sub.wait_for_version(reported + 1, timeout=1.0):
                reported = sub.version  # the trainer waits for this line before the next
                got = digest(flatten(sub.weights))
                print(json.dumps({"event": "seen", "version": reported, "digest": got}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
