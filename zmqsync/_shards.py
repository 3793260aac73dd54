"""A sharded trainer's weights: which ranks publish together, and each rank's write.

When a `Publisher`'s weights hold DTensors (FSDP2's ``fully_shard``, tensor parallel
``parallelize_module``, or both), the slots still hold every tensor at its full logical
shape, and every rank of the DTensors' mesh writes its own piece in place (`_slices`
says where): no rank gathers, no rank holds a full copy. This module is the torch side
of that:

* `Shards.of` reads the mesh of every DTensor once: the ranks that publish together
  (the group: every rank of the world, hosted by the lowest), this rank's coordinate on
  each tensor's mesh, its placements. What cannot be published is refused by name:
  a Partial placement (a pending reduction), a mesh on another device type than CPU,
  a rank outside the mesh, meshes that leave out some of the world's ranks.
* `Shards.agree` is the one collective: at construction, every rank learns the host's
  bus id and checks that all ranks are on this host and built the same layout.
* `ShardWriter` writes this rank's part of a version into a slot's views: the pieces it
  holds (once per replicated group: `_slices.writes`; a DTensor on a submesh, such as
  FSDP2's dp mesh inside a 2D one, by its lowest submesh) and, on the host, every plain
  tensor. A piece that is one byte range goes by the native copy, the rest by torch.

Who writes when, and how a publish completes on every rank, is `_rank_page`'s.
"""

from __future__ import annotations

import hashlib
import math
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from . import _slices
from ._copy import ByteCopies, bytes_are_values
from ._errors import LayoutMismatch
from ._layout import Key, Layout
from ._tensor_kinds import is_dtensor

__all__ = ["Piece", "ShardWriter", "Shards", "piece_of"]


@dataclass(frozen=True)
class Piece:
    """Where this rank's part of one DTensor lies (plain numbers, for `_slices`)."""

    placements: tuple[_slices.Placement, ...]
    mesh: tuple[int, ...]
    coordinate: tuple[int, ...]


def _name(key: Key) -> str:
    return ".".join(key)


def _placements(key: Key, tensor: Any) -> tuple[_slices.Placement, ...]:
    from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

    out: list[_slices.Placement] = []
    for p in tensor.placements:
        if isinstance(p, _StridedShard):  # a Shard too: asked first
            out.append(_slices.StridedShard(p.dim, int(p.split_factor)))
        elif isinstance(p, Shard):
            out.append(_slices.Shard(p.dim))
        elif isinstance(p, Replicate):
            out.append(_slices.Replicate())
        else:
            raise TypeError(
                f"{_name(key)!r} is a DTensor with placement {p}: its values are a pending "
                "reduction, not bytes to publish; redistribute it to Shard or Replicate first"
            )
    return tuple(out)


def piece_of(key: Key, tensor: Any) -> Piece:
    """Where this rank's part of DTensor `tensor` lies in the full tensor, as plain
    numbers for `_slices` (a tensor-parallel worker's slice is the same question).

    Raises:
        TypeError: a Partial placement, a mesh of another device type than CPU, or a
            mesh that leaves out this rank, naming the tensor.
    """
    mesh = tensor.device_mesh
    if mesh.device_type != "cpu":
        raise TypeError(
            f"{_name(key)!r} is a DTensor on a {mesh.device_type} mesh: shards are written "
            "from CPU meshes for now; publish a full state_dict from one rank instead (see "
            "docs/guide.md)"
        )
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise TypeError(f"{_name(key)!r} is a DTensor whose mesh leaves out this rank")
    return Piece(_placements(key, tensor), tuple(mesh.shape), tuple(coordinate))


def _host_id() -> str:
    """This host, as ranks compare it: the name and the boot (containers share both
    when they share the shared memory a slot lives in)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _digest(layout: Layout) -> int:
    """The layout as 63 bits, for ranks (and the page) to compare."""
    text = repr([(s.key, s.dtype, s.shape, s.offset) for s in layout.specs])
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


class Shards:
    """The group of ranks that publish one sharded model together, seen from this rank.

    Attributes:
        ranks: the group's global ranks, in order; ``ranks[0]`` hosts the bus.
        index: this rank's place in `ranks` (0: the host).
        pieces: each DTensor's `Piece` for this rank; plain tensors are not listed.
        digest: the layout, hashed (every rank must build the same).
        bus_id: the host's bus id, once `agree` ran.
    """

    def __init__(self, ranks: tuple[int, ...], rank: int, pieces: dict[Key, Piece], digest: int):
        self.ranks, self.rank = ranks, rank
        self.index = ranks.index(rank)
        self.pieces = pieces
        self.digest = digest
        self.bus_id = ""
        self.firsts: dict[Key, int] = {}  # each DTensor's mesh's lowest rank
        self.elsewhere: frozenset[Key] = frozenset()  # DTensors another submesh writes

    @property
    def host(self) -> bool:
        return self.index == 0

    @classmethod
    def of(cls, flat: Mapping[Key, torch.Tensor], layout: Layout) -> Shards:
        """Read every DTensor's mesh (see the module doc). No communication.

        Raises:
            TypeError: a DTensor that cannot be published, named.
            NotImplementedError: meshes over only some of the world's ranks.
        """
        import torch.distributed as dist

        pieces: dict[Key, Piece] = {}
        firsts: dict[Key, int] = {}
        covered: set[int] = set()
        for key, tensor in flat.items():
            if not is_dtensor(tensor):
                continue
            pieces[key] = piece_of(key, tensor)
            ranks = [int(r) for r in tensor.device_mesh.mesh.flatten().tolist()]  # type: ignore[attr-defined]
            firsts[key] = min(ranks)
            covered.update(ranks)
        world = dist.get_world_size()
        if covered != set(range(world)):
            raise NotImplementedError(
                f"the DTensors' meshes cover ranks {sorted(covered)} of a world of {world}: "
                "a sharded publisher needs meshes over every rank of the world"
            )
        shards = cls(tuple(sorted(covered)), dist.get_rank(), pieces, _digest(layout))
        shards.firsts = firsts
        return shards

    def agree(self, bus_id: str) -> None:
        """The one collective: every rank takes the host's `bus_id`, after checking that
        every rank is on this host and built the same layout.

        Raises:
            TypeError: the mesh spans hosts, or ranks built other layouts (on every rank).
        """
        import torch.distributed as dist

        mine = (_host_id(), bus_id, self.digest, self.firsts)
        everyone: list[Any] = [None] * len(self.ranks)
        dist.all_gather_object(everyone, mine)
        hosts = sorted({host for host, _, _, _ in everyone})
        first = next(iter(self.pieces), ("weights",))
        if len(hosts) > 1:
            names = ", ".join(h.split("/")[0] for h in hosts)
            raise TypeError(
                f"{_name(first)!r} is a DTensor whose mesh spans {len(hosts)} hosts ({names}): "
                "a sharded publisher writes one host's shared memory; publish per host (see "
                "docs/multi-host.md)"
            )
        other = [
            r for r, (_, _, d, _) in zip(self.ranks, everyone, strict=True) if d != self.digest
        ]
        if other:
            raise TypeError(
                f"ranks {other} laid their weights out otherwise than rank {self.rank}: every "
                "rank must build the same model (keys, full shapes, dtypes) and Publisher"
            )
        self.bus_id = everyone[0][1]
        # a DTensor on a submesh (FSDP2's dp mesh inside a 2D one, for the tensors TP left
        # alone) has a replica on every other submesh: the lowest one writes it
        self.elsewhere = frozenset(
            key
            for key, first in self.firsts.items()
            if first > min(theirs.get(key, first) for _, _, _, theirs in everyone)
        )


@dataclass(frozen=True)
class _Plan:
    key: Key
    piece: Piece | None  # None: a plain tensor (written whole, by the host)
    local_shape: tuple[int, ...]
    boxes: tuple[tuple[tuple[slice, ...], tuple[slice, ...]], ...]  # (full, local)
    offset: int  # when the piece is one byte range of the full tensor: where
    nbytes: int  # and how long (0: not one range)


class ShardWriter:
    """Writes this rank's part of a version into a slot's views (see the module doc)."""

    def __init__(self, layout: Layout, shards: Shards) -> None:
        self._plans: list[_Plan] = []
        for spec in layout.specs:
            piece = shards.pieces.get(spec.key)
            if piece is None:
                if shards.host:
                    self._plans.append(_Plan(spec.key, None, spec.shape, (), 0, spec.nbytes))
                continue
            args = (spec.shape, piece.placements, piece.mesh, piece.coordinate)
            if spec.key in shards.elsewhere or not _slices.writes(
                piece.placements, piece.coordinate
            ):
                continue  # a replica another rank writes
            boxes = tuple(
                (
                    tuple(slice(a, b) for a, b in box.full),
                    tuple(slice(a, b) for a, b in box.local),
                )
                for box in _slices.boxes(*args)
            )
            if not boxes:
                continue  # this rank's piece is empty (FSDP2's last ranks of a short dim)
            item = spec.nbytes // max(1, math.prod(spec.shape))
            ranges = _slices.byte_ranges(spec.shape, item, *args[1:])
            offset, nbytes = ranges[0] if len(ranges) == 1 else (0, 0)
            self._plans.append(
                _Plan(spec.key, piece, _slices.local_shape(*args), boxes, offset, nbytes)
            )

    def write(self, views: Mapping[Key, torch.Tensor], flat: Mapping[Key, torch.Tensor]) -> int:
        """Copy this rank's part of `flat` into `views` (one slot's); returns the bytes.

        Raises:
            LayoutMismatch: a local shard has another shape than its mesh gives it.
        """
        moves: list[tuple[int, int, int]] = []
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        written = 0
        with torch.no_grad():
            for plan in self._plans:
                tensor = flat[plan.key]
                local = tensor.to_local() if plan.piece is not None else tensor  # type: ignore[attr-defined]
                if tuple(local.shape) != plan.local_shape:
                    raise LayoutMismatch(
                        f"{_name(plan.key)!r}: this rank holds a shard of {list(local.shape)}, "
                        f"its mesh gives it {list(plan.local_shape)}; reshard as at start"
                    )
                view = views[plan.key]
                if plan.nbytes and bytes_are_values(local) and local.dtype == view.dtype:
                    moves.append((view.data_ptr() + plan.offset, local.data_ptr(), plan.nbytes))
                    written += plan.nbytes
                elif plan.piece is None:
                    copies.append((view, local))
                    written += view.nbytes
                else:
                    for full, part in plan.boxes:
                        dst = view[full]
                        copies.append((dst, local[part]))
                        written += dst.numel() * dst.element_size()
            ByteCopies(moves).run()
            for dst, src in copies:
                dst.copy_(src)
        return written
