"""Bit-exact checksums of weights, used by `zmqsync demo`/`worker --verify` and tests.

A trainer may publish a ``_checksum`` tensor (16 bytes as int64[2]) holding the digest
of every other tensor; it travels in the same slot, so a worker can prove that what it
applied is exactly what was published, version by version.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch

__all__ = ["CHECKSUM_KEY", "digest", "digest_tensor", "stored_digest"]

CHECKSUM_KEY = ("_checksum",)


def digest(flat: Mapping[tuple[str, ...], torch.Tensor]) -> str:
    """Hex blake2b-128 of every tensor's bytes (sorted keys), the checksum key excluded."""
    h = hashlib.blake2b(digest_size=16)
    for key in sorted(flat):
        if key == CHECKSUM_KEY:
            continue
        tensor = flat[key].detach().to("cpu").contiguous().reshape(-1)
        h.update(".".join(key).encode())
        h.update(tensor.view(torch.uint8).numpy().data)
    return h.hexdigest()


def digest_tensor(hex_digest: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(bytes.fromhex(hex_digest)), dtype=torch.int64).clone()


def stored_digest(flat: Mapping[tuple[str, ...], torch.Tensor]) -> str | None:
    """The digest the publisher stored in the ``_checksum`` tensor, if there is one."""
    tensor = flat.get(CHECKSUM_KEY)
    if tensor is None:
        return None
    return bytes(tensor.detach().to("cpu").contiguous().view(torch.uint8).numpy()).hex()
