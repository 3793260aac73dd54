"""A saturated host for tests: CPU-bound processes on every core, as our users have.

``with Burners() as burners: burners.start(n, seconds)`` starts n processes that spin
until `seconds` have passed (so a lost test cannot leave them behind for long); every
one is killed on the way out, and `Burners.stop` ends some early.
"""

from __future__ import annotations

import os
import sys

from tests.conftest import Proc

_SPIN = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end: pass"


class Burners:
    """CPU-bound processes, all killed when the block ends."""

    def __init__(self) -> None:
        self.procs: list[Proc] = []

    def __enter__(self) -> Burners:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(self.procs)

    def start(self, n: int, seconds: float) -> list[Proc]:
        """`n` more processes, each ending by itself after `seconds`."""
        code = _SPIN.format(seconds=seconds)
        new = [Proc([sys.executable, "-c", code], dict(os.environ)) for _ in range(n)]
        self.procs.extend(new)
        return new

    @staticmethod
    def stop(procs: list[Proc]) -> None:
        """End these burners now."""
        for proc in procs:
            proc.kill()
