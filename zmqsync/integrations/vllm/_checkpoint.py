"""What a vLLM engine's checkpoint holds: names and shapes, read from safetensors headers.

vLLM's in-place reload (``model_runner.reload_weights``) moves each layer to the meta
device, loads, then processes it again: a name it does not know or a shape that does not
fit fails halfway, and the engine is left with layers that hold no weights. So a version
is checked before any of it reaches the engine, against the one list of names the
model's own loader accepts for sure: the checkpoint the engine was started from.

A safetensors file begins with an 8-byte little-endian length and a JSON header naming
each tensor's dtype, shape and offsets; reading it touches no tensor data and needs no
package (and nothing in it is executed or unpickled).
"""

from __future__ import annotations

import json
import logging
import os
import struct
from collections.abc import Mapping
from pathlib import Path

import torch

__all__ = ["Expected", "checkpoint_shapes", "mismatch", "not_finite"]

log = logging.getLogger(__name__)

Expected = Mapping[str, tuple[int, ...]]
_HEADER_MAX = 100 * 1024 * 1024  # a header larger than this is not a safetensors file
_SHOWN = 5  # names listed in an error, at most


def checkpoint_shapes(model: str) -> dict[str, tuple[int, ...]] | None:
    """``{name: shape}`` of every tensor in the local checkpoint `model` (a directory of
    ``*.safetensors``), or None where there is none to read (a hub id not on this disk,
    another format): then names are checked by vLLM's loader alone."""
    path = Path(model)
    if not path.is_dir():
        path = _hub_snapshot(model) or path
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        return None
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        shapes.update(_header_shapes(file))
    return shapes


def _hub_snapshot(model: str) -> Path | None:
    """The local snapshot of a hub id, if huggingface_hub has one (no download)."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    try:
        return Path(snapshot_download(model, local_files_only=True))
    except Exception:  # noqa: BLE001 - any failure means: no local copy to read
        return None


def _header_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > min(_HEADER_MAX, os.fstat(f.fileno()).st_size):
            raise ValueError(f"{file} is not a safetensors file (header length {length})")
        header = json.loads(f.read(length))
    return {
        name: tuple(int(n) for n in entry["shape"])
        for name, entry in header.items()
        if name != "__metadata__"
    }


def mismatch(published: Mapping[str, torch.Tensor], expected: Expected) -> str:
    """Why `published` cannot be loaded into a model whose checkpoint is `expected`, or ""."""
    unknown = sorted(set(published) - set(expected))
    missing = sorted(set(expected) - set(published))
    shapes = sorted(
        f"{name} {tuple(t.shape)} (the engine's is {expected[name]})"
        for name, t in published.items()
        if name in expected and tuple(t.shape) != tuple(expected[name])
    )
    reasons = []
    if unknown:
        reasons.append(f"{len(unknown)} name(s) the engine's model does not have: {_few(unknown)}")
    if missing:
        reasons.append(f"{len(missing)} of its tensor(s) not published: {_few(missing)}")
    if shapes:
        reasons.append(f"{len(shapes)} shape(s) differ: {_few(shapes)}")
    return "; ".join(reasons)


def not_finite(published: Mapping[str, torch.Tensor]) -> list[str]:
    """The names of floating-point tensors holding a NaN or an infinity."""
    return sorted(
        name
        for name, t in published.items()
        if t.is_floating_point() and not bool(torch.isfinite(t).all())
    )


def _few(items: list[str]) -> str:
    shown = ", ".join(items[:_SHOWN])
    return shown + (f", ... ({len(items) - _SHOWN} more)" if len(items) > _SHOWN else "")
