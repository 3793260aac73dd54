"""The handshake budget: tokens at a fixed rate, handed out in the order workers asked.

A handshake costs the publisher a registration and a WELCOME (the whole manifest, and
for a worker that reads the CPU copy of CUDA weights, a copy of the current version), so
`PublisherRole.admit` spends one token on each, refilled at `rate` per second up to a
burst of two seconds' worth. Refusals that cost nothing more than their answer (a worker
id in use, a full bus) are decided before and never spend one: a flood of HELLOs for a
live worker's id takes nothing from the workers that join meanwhile.

When the tokens run out, each worker id refused gets a place in line, and the tokens
that come next go to the ids in line in the order they first asked: a worker that
retries keeps its place, and a newcomer gets a token only when everyone in line could
have one too. So a burst of joins larger than the burst of tokens is served first come
first served, and no worker is starved by others that retry faster.

Bounds: at most `places` ids wait at once (one more is refused without a place, and may
ask again); a place is kept only while its worker asks again within `hold_s`, so ids
that stop asking (a storm that moved on, a worker that gave up) free theirs. The rate is
per bus, not per peer: an attacker with many ids gets in line like anyone, one place per
id, and an honest worker behind k of them waits about k / `rate` seconds.

No I/O and no clock: the caller passes `now` (monotonic seconds).
"""

from __future__ import annotations

__all__ = ["HandshakeQueue"]


class HandshakeQueue:
    """Handshake tokens at `rate` per second, first to the ids that have waited longest.

    Args:
        rate: tokens per second; the bucket holds two seconds' worth.
        now: the time the bucket starts full.
        places: how many ids may wait in line at once.
        hold_s: a place is dropped when its id has not asked again for this long.
    """

    def __init__(self, rate: float, now: float, *, places: int = 1024, hold_s: float = 2.0) -> None:
        self.rate, self.places, self.hold_s = rate, places, hold_s
        self._burst = 2 * rate
        self._tokens, self._at = self._burst, now
        self._line: dict[str, float] = {}  # id -> when it last asked; in order of arrival

    @property
    def waiting(self) -> int:
        """Ids in line now (some may have stopped asking: they go when they are reached)."""
        return len(self._line)

    def take(self, key: str, now: float) -> bool:
        """Whether the handshake of worker id `key` may go ahead now (a token is spent).

        Refused, it keeps (or gets) its place in line; the first ``floor(tokens)`` ids in
        line that still ask are the ones served, and one not in line only if the tokens
        outnumber them.
        """
        self._tokens = min(self._burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        line = self._line
        if key in line:
            line[key] = now
        free = int(self._tokens)
        ahead, served, stale = 0, False, []
        if free:
            for waiting, asked in line.items():
                if ahead >= free:
                    break
                if now - asked > self.hold_s:
                    stale.append(waiting)
                elif waiting == key:
                    served = True
                    break
                else:
                    ahead += 1
            for waiting in stale:
                del line[waiting]
        if served or (key not in line and ahead < free):
            line.pop(key, None)
            self._tokens -= 1
            return True
        if key not in line and len(line) < self.places:
            line[key] = now
        return False
