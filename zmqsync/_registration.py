"""What a HELLO registers as its worker's transport: the one rule both sides agree on.

The publisher records a worker's transport with `registered` (see
`PublisherRole.admit`), and a subscriber whose decision after WELCOME differs from what
its HELLO registered says so in a second HELLO (see ``_subscriber.py``). The rest of
the transport decision lives in ``_buffers/transport.py``, which re-exports these names;
they live here, outside the ``_buffers`` package (whose ``__init__`` loads torch), so
that the publisher's role loads no tensors.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["CPU_PUBLISHER", "NOTE_MAX", "Decision", "clip_note", "registered"]

NOTE_MAX = 256  # Hello.transport_note / WorkerEntry.transport_note
CPU_PUBLISHER = "the bus carries CPU weights: the worker copies them to its own device"


class Decision(NamedTuple):
    """A transport ("cuda" or "cpu") and, for a fallback, the reason (else "")."""

    transport: str
    reason: str


def clip_note(text: str) -> str:
    """`text` cut to NOTE_MAX characters, marked with "..." where it was cut."""
    return text if len(text) <= NOTE_MAX else text[: NOTE_MAX - 3] + "..."


def registered(transport: str, note: str, bus_has_cuda: bool) -> Decision:
    """The (transport, note) the publisher records for a HELLO.

    On a bus without CUDA buffers every worker reads the CPU segment: one that asked for
    "cuda" copies host-to-device itself (and is told so); a note about CUDA is noise.
    """
    if bus_has_cuda:
        return Decision(transport, clip_note(note))
    return Decision("cpu", CPU_PUBLISHER if transport == "cuda" else "")
