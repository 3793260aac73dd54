"""zmqsync: move PyTorch weights from a trainer to many workers on one host.

Weights live in shared buffers created once; ZeroMQ carries only small msgpack control
messages. Nothing received is ever unpickled.

    with zmqsync.Publisher(model, name="policy") as pub:   # trainer
        pub.publish()

    with zmqsync.Subscriber(name="policy", model=policy) as sub:   # any other process
        sub.wait_for_version(1)

The names below load on first use (PEP 562): `import zmqsync` alone costs milliseconds,
so the operator's commands that never touch a tensor (``zmqsync --help``, ``inspect``,
``sniff``, ``gc``) start without importing torch, while ``zmqsync.Publisher`` in a
script is the class itself, as with an eager import.
"""

import importlib as _importlib
import typing as _typing

if _typing.TYPE_CHECKING:  # what type checkers and IDEs see: the names, eagerly
    from ._errors import (
        BufferUnavailable,
        ClosedError,
        ConnectTimeout,
        FdLimitTooLow,
        LayoutMismatch,
        ProtocolError,
        PublishTimeout,
        RanksFailed,
        SharedMemoryFull,
        ZmqSyncError,
    )
    from ._publisher import Publish, Publisher
    from ._reads import Aliases, Copies
    from ._registry import WorkerInfo
    from ._security import CurveClient, CurveServer, Security, curve_keypair
    from ._subscriber import Reading, Subscriber
    from ._writes import Copy, Live, Overlapped
    from .relay import Branch, Relay, RelayRoot, Tree

__version__ = "0.1.0"

__all__ = [
    "Aliases",
    "Branch",
    "BufferUnavailable",
    "ClosedError",
    "ConnectTimeout",
    "Copies",
    "Copy",
    "curve_keypair",
    "CurveClient",
    "CurveServer",
    "FdLimitTooLow",
    "LayoutMismatch",
    "Live",
    "Overlapped",
    "ProtocolError",
    "Publish",
    "Publisher",
    "PublishTimeout",
    "RanksFailed",
    "Reading",
    "Relay",
    "RelayRoot",
    "Security",
    "SharedMemoryFull",
    "Subscriber",
    "Tree",
    "WorkerInfo",
    "ZmqSyncError",
]

# public name -> the private module that defines it
_WHERE = {
    "BufferUnavailable": "._errors",
    "ClosedError": "._errors",
    "ConnectTimeout": "._errors",
    "FdLimitTooLow": "._errors",
    "LayoutMismatch": "._errors",
    "ProtocolError": "._errors",
    "PublishTimeout": "._errors",
    "RanksFailed": "._errors",
    "SharedMemoryFull": "._errors",
    "ZmqSyncError": "._errors",
    "Publish": "._publisher",
    "Publisher": "._publisher",
    "WorkerInfo": "._registry",
    "CurveClient": "._security",
    "CurveServer": "._security",
    "curve_keypair": "._security",
    "Security": "._security",
    "Aliases": "._reads",
    "Copies": "._reads",
    "Copy": "._writes",
    "Live": "._writes",
    "Overlapped": "._writes",
    "Reading": "._subscriber",
    "Subscriber": "._subscriber",
    "Relay": ".relay",
    "RelayRoot": ".relay",
    "Branch": ".relay",
    "Tree": ".relay",
}


def __getattr__(name: str) -> _typing.Any:
    """Import the module behind a public name on first use, and keep the name here."""
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'zmqsync' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module, __name__), name)
    globals()[name] = value  # the next access is an ordinary attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
