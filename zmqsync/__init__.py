"""zmqsync: move PyTorch weights from a trainer to many workers on one host.

Weights live in shared buffers created once; ZeroMQ carries only small msgpack control
messages. Nothing received is ever unpickled.

    with zmqsync.Publisher(model, name="policy") as pub:   # trainer
        pub.publish()

    with zmqsync.Subscriber(name="policy", model=policy) as sub:   # any other process
        sub.wait_for_version(1)
"""

from ._errors import (
    BufferUnavailable,
    ClosedError,
    ConnectTimeout,
    LayoutMismatch,
    ProtocolError,
    PublishTimeout,
    SharedMemoryFull,
    ZmqSyncError,
)
from ._publisher import Publish, Publisher
from ._registry import WorkerInfo
from ._security import CurveClient, CurveServer, curve_keypair
from ._subscriber import Reading, Subscriber
from .relay import Relay, RelayRoot

__version__ = "0.1.0"

__all__ = [
    "BufferUnavailable",
    "ClosedError",
    "ConnectTimeout",
    "curve_keypair",
    "CurveClient",
    "CurveServer",
    "LayoutMismatch",
    "ProtocolError",
    "Publish",
    "Publisher",
    "PublishTimeout",
    "Reading",
    "Relay",
    "RelayRoot",
    "SharedMemoryFull",
    "Subscriber",
    "WorkerInfo",
    "ZmqSyncError",
]
