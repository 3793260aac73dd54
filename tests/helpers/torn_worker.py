"""Alias + manual worker that checks, between polls, that no read mixes two versions.

Every tensor of version v is filled with v % 100 by the test's trainer, so a read that
sees two different values (or a value that is not its version's) is torn. With slots=1
it follows the protocol for that case: results inside a `reading()` block whose
`torn` is True are discarded (and counted).
"""

import json
import sys

import zmqsync


def main() -> int:
    name, mode = sys.argv[1], sys.argv[2]
    reads = torn = bad = 0
    versions = set()
    with zmqsync.Subscriber(
        name=name,
        reads=(zmqsync.Aliases(manual=True) if mode == "alias" else zmqsync.Copies(manual=True)),
        timeout=20,
    ) as sub:
        print(json.dumps({"event": "ready", "version": sub.version}), flush=True)
        while not sub.stopped:
            sub.poll(0.0)
            with sub.reading() as r:
                values = set()
                for t in sub._reader.target.tensors.values():
                    values.add(float(t.min()))
                    values.add(float(t.max()))
            reads += 1
            if r.torn:
                torn += 1
                continue
            versions.add(r.version)
            if values != {float(r.version % 100)}:
                bad += 1
    print(
        json.dumps(
            {
                "event": "summary",
                "reads": reads,
                "torn": torn,
                "bad": bad,
                "versions": len(versions),
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
