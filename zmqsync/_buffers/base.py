"""The buffer transport contract: what the publisher and subscribers need of a buffer.

One file per kind implements both sides; none of them knows about ZeroMQ. A
description travels in WELCOME as plain fields (`BufferInfo`), enough for `attach`,
nothing to unpickle.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar, TypeVar

import torch

from .._protocol import BufferInfo
from .header import Header

__all__ = ["AttachedBuffer", "SharedBuffer"]

_B = TypeVar("_B", bound="SharedBuffer")


class SharedBuffer(abc.ABC):
    """A buffer this process allocated and writes (publisher side)."""

    kind: ClassVar[str]
    header: Header

    def __enter__(self: _B) -> _B:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @abc.abstractmethod
    def slot(self, index: int) -> torch.Tensor:
        """The flat uint8 tensor of slot `index`, writable."""

    @abc.abstractmethod
    def describe(self) -> BufferInfo:
        """Plain fields for WELCOME: enough for attach(), nothing to unpickle."""

    @abc.abstractmethod
    def close(self) -> None:
        """Unmap and unlink. Idempotent."""


class AttachedBuffer(abc.ABC):
    """A buffer another process allocated, mapped here read-only (subscriber side)."""

    kind: ClassVar[str]
    header: Header

    @classmethod
    @abc.abstractmethod
    def attach(cls, info: BufferInfo, *, slots: int, slot_bytes: int, **options: Any) -> Any:
        """Map the buffer `info` describes. Raises ProtocolError or BufferUnavailable."""

    @abc.abstractmethod
    def slot(self, index: int) -> torch.Tensor:
        """The flat uint8 tensor of slot `index` (read-only memory)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Drop this side's references; the mapping goes when the last view dies."""
