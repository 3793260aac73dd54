"""Shared buffers: one flat segment per device = a header page + `slots` copies."""

from .base import AttachedBuffer, SharedBuffer
from .cpu import CpuAttachment, CpuSegment, collect_garbage, segment_name
from .cuda import CudaAttachment, CudaBuffer
from .header import Header

__all__ = [
    "AttachedBuffer",
    "CpuAttachment",
    "CpuSegment",
    "CudaAttachment",
    "CudaBuffer",
    "Header",
    "SharedBuffer",
    "collect_garbage",
    "segment_name",
]
