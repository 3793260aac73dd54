"""Peer-controlled text made safe for a terminal or a log line.

A worker id, a host name, a STOP or ERROR reason, a bus name in STATE: all of it comes
from a peer, and any local process can be a peer. Written raw, such text can move the
cursor, retitle the window, plant an OSC 8 link, clear the screen, or (with a newline)
forge a whole log line. `printable` shows every character that is not printable as a
Python escape, so the text reads the same and does nothing.

Rich markup (``[/bold]``) is a second, separate hazard for whatever prints through rich
with markup on; the CLI escapes it there (`rich.markup.escape`), so this module needs
nothing but the standard library.
"""

from __future__ import annotations

__all__ = ["printable"]

_LIMIT = 1024


def printable(text: object, limit: int = _LIMIT) -> str:
    """`text` with every non-printable character escaped (``\\x1b``, ``\\n``, ``\\u202e``),
    cut to `limit` characters (then marked with ``…``).

    `str.isprintable` is False for control characters (C0, C1, DEL), line and paragraph
    separators, and format characters such as bidirectional overrides; a space is
    printable. Plain text is returned as is, so calling this on the hot path costs one
    scan.
    """
    text = text if isinstance(text, str) else str(text)
    cut = len(text) > limit
    if cut:
        text = text[:limit]
    if not text.isprintable():
        text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text + "…" if cut else text
