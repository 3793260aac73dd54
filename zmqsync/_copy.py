"""Every byte copy between a model and a slot: the plans, the native loop, its settings.

Two directions, planned once per slot and run per version:

* `WritePlan`: the publisher's write of a version into a slot. A few small CPU tensors
  go as bytes (no dispatcher, no grad mode), more of them in one ``_foreach_copy_``,
  big ones by torch's ``copy_`` on its threads (the trainer's cores are free then), CUDA
  tensors device to device, and their CPU copies when a worker reads those. float32
  tensors into bf16 slots go through the native cast (`Bf16Casts`).
* `CopyPlan`: a copy-mode worker's copy from a slot into its model: every plain CPU
  tensor as bytes in one native call without the GIL (`ByteCopies`), the rest in one
  foreach or one by one.

Both run on threads that come to each version with cold caches, after the other
processes ran: per-tensor interpreter work is what they save. No zmq here, and no
knowledge of slots or seqlocks (`_slots` decides when a write happens).
"""

from __future__ import annotations

import ctypes
import os
from array import array
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

Key = tuple[str, ...]

__all__ = [
    "BYTE_COPY_MAX",
    "CAST_STREAM_MIN",
    "COPY_THREADS",
    "FOREACH_MAX",
    "MEMMOVE_ALL_MAX",
    "NATIVE_CAST",
    "NATIVE_COPY",
    "SHARED_COPY_MAX",
    "SHARED_COPY_MIN",
    "STREAM_COPY_MIN",
    "Bf16Casts",
    "ByteCopies",
    "ByteMove",
    "CopyPlan",
    "WritePlan",
    "by_view",
    "byte_view",
    "bytes_are_values",
    "shares_copy",
    "write_plan",
]


# The publisher writes a model of at most this many small tensors as bytes, one copy per
# tensor: it comes back to each publish with cold caches (9 processes take turns on 2
# cores in the benchmark), and torch's dispatcher and grad-mode switch touch far more
# code than a byte copy does. More tensors go through one `_foreach_copy_`: checking
# each source for a byte copy (`bytes_are_values`) would cost about as much.
MEMMOVE_ALL_MAX = 64

# Copies up to this many bytes go by memoryview assignment (`byte_view`), larger ones by
# ctypes.memmove, which releases the GIL for the copy.
BYTE_COPY_MAX = 1 << 16


def by_view(nbytes: int) -> bool:
    """Whether a byte copy of `nbytes` goes by `byte_view` (else by ctypes.memmove)."""
    return 0 < nbytes <= BYTE_COPY_MAX


def byte_view(address: int, nbytes: int) -> memoryview:
    """The `nbytes` at `address` as a writable byte memoryview.

    ``dst[:] = src`` between two of them is a memcpy without ctypes' foreign-call
    machinery: half the CPU of `ctypes.memmove` for 8 small tensors on a cold thread
    (3.3 against 6.7 us). It holds the GIL, so only small copies (`BYTE_COPY_MAX`) go
    this way. The view does not own the memory: whoever keeps it must know that
    `address` still holds `nbytes`.
    """
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


def _native_copy() -> Callable[..., None] | None:
    """`_native.copy_many` when the extension was built and ZMQSYNC_NATIVE is not "0"."""
    if os.environ.get("ZMQSYNC_NATIVE", "1") == "0":
        return None
    try:
        from ._native import copy_many
    except ImportError:  # installed without a C compiler: copies go from Python
        return None
    return copy_many  # type: ignore[no-any-return]


def _copy_threads() -> int:
    """Threads a big native copy is shared among: ZMQSYNC_COPY_THREADS, else the CPUs
    this process may run on, at most 4 (a cap: past a few threads a copy is bound by
    memory bandwidth; only 2 could be measured here)."""
    setting = os.environ.get("ZMQSYNC_COPY_THREADS", "")
    if setting:
        try:
            threads = int(setting)
        except ValueError:
            raise ValueError(
                f"ZMQSYNC_COPY_THREADS={setting!r}: give a whole number from 1 to 64"
            ) from None
        if not 1 <= threads <= 64:
            raise ValueError(f"ZMQSYNC_COPY_THREADS={threads}: give a number from 1 to 64")
        return threads
    return max(1, min(4, len(os.sched_getaffinity(0))))


def _native_cast() -> Callable[..., None] | None:
    """`_native.cast_bf16` when the extension was built and ZMQSYNC_NATIVE is not "0"."""
    if os.environ.get("ZMQSYNC_NATIVE", "1") == "0":
        return None
    try:
        from ._native import cast_bf16
    except ImportError:  # installed without a C compiler (or an older build): torch casts
        return None
    return cast_bf16  # type: ignore[no-any-return]


# Copies many byte ranges in one call without the GIL; None: not built (or turned off).
NATIVE_COPY = _native_copy()
# Casts float32 to bf16 as torch does, bit for bit, faster; None: torch casts.
NATIVE_CAST = _native_cast()
COPY_THREADS = _copy_threads()

# A native copy of at least this many bytes is shared among COPY_THREADS threads. Below
# it, starting the helpers (~45 us each here) costs what the second thread saves: a
# 4 MiB copy took 0.10 ms on one thread, 0.12 ms on two. A copy-mode publish to one
# worker, the worker's copy shared or not (``python -m tools.bench steps shared-copy``,
# after a torch step in the trainer): 16 MB 2.87 against 3.12 ms, 64 MB 13.2 against
# 14.3 ms. With the
# other core busy a 64 MiB copy took 7.2 ms shared, 7.4 ms on one thread and 9.6 ms by
# torch's copy_ (its OpenMP threads wait for each other).
SHARED_COPY_MIN = 16 << 20

# ...unless one of its copies is bigger than this: then it runs whole, on one thread.
# glibc's memcpy writes a copy past its threshold (3/4 of the shared cache: 181.5 MiB
# here, x86.non_temporal_threshold in `ld.so --list-diagnostics`) with non-temporal
# stores, and a shared copy's 512 KiB pieces never reach it. One copy from /dev/shm into
# private memory, alternated (load 5-7): 200 MiB 15.7 ms whole against 28.1 ms shared
# among two threads, 1100 MiB (the LLM-shaped model's block) 92 against 163 ms. In the
# bench, 4 copy workers of that model: 279-282 ms whole, 316-444 ms shared and streamed.
SHARED_COPY_MAX = 128 << 20

# A shared plan of at least this many bytes in all is written with non-temporal stores
# (the native loop's `stream`), as memcpy would write it whole: 512 MiB in four copies of
# 128 MiB, 63 ms streamed against 77 ms plain (shared among two threads); the 512 MB MLP
# to one copy worker in the bench, 79 against 85 ms per publish.
STREAM_COPY_MIN = 128 << 20


# A cast writing at least this many bytes uses non-temporal stores: they bypass the
# caches, which pays once the destination is far bigger than them. Here (float32 source
# in memory, bf16 slot in /dev/shm, one thread, against torch's float32 copy_) a 64 MB
# source cast in 0.59x with plain stores and 0.74x streaming; 256 MB in 0.71x plain and
# 0.59x streaming.
CAST_STREAM_MIN = 64 << 20


class Bf16Casts:
    """float32 tensors cast into a slot's bf16 views by the native cast, in one call.

    The sources are the trainer's tensors, read again at every publish, so the plan
    (destination, source, value count) is made per publish from their data pointers;
    a source that is not a plain contiguous float32 CPU tensor (or no native cast) is
    left to torch, which casts the same bits. A plan of `SHARED_COPY_MIN` source bytes
    or more runs on torch's intra-op thread count, the threads torch's float32 copy_
    of a big tensor uses.
    """

    __slots__ = ("_cast", "keys", "views")

    def __init__(self, pairs: Iterable[tuple[Key, torch.Tensor]]) -> None:
        pairs = list(pairs)
        self._cast = NATIVE_CAST
        self.keys = [key for key, _ in pairs]
        self.views = [view for _, view in pairs]

    def run(self, flat: Mapping[Key, torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Cast what the native cast takes; returns the (view, source) pairs left over."""
        left: list[tuple[torch.Tensor, torch.Tensor]] = []
        plan = array("Q")
        values = 0
        for key, view in zip(self.keys, self.views, strict=True):
            source = flat[key]
            n = view.numel()
            if self._cast is None or source.dtype != torch.float32 or not bytes_are_values(source):
                left.append((view, source))
            elif n:
                plan.extend((view.data_ptr(), source.data_ptr(), n))
                values += n
        if values and self._cast is not None:
            threads = torch.get_num_threads() if 4 * values >= SHARED_COPY_MIN else 1
            self._cast(plan, max(1, min(threads, 64)), 2 * values >= CAST_STREAM_MIN)
        return left


def shares_copy(sizes: Iterable[int]) -> bool:
    """Whether a native plan of copies of `sizes` bytes is shared among `COPY_THREADS`
    threads: `SHARED_COPY_MIN` bytes in all, none over `SHARED_COPY_MAX`."""
    sizes = list(sizes)
    return (
        NATIVE_COPY is not None
        and COPY_THREADS > 1
        and sum(sizes) >= SHARED_COPY_MIN
        and max(sizes) <= SHARED_COPY_MAX
    )


class ByteCopies:
    """Byte copies planned once (destination, source, byte count) and run many times.

    With the native extension they are one call that walks the plan without the GIL: a
    worker's copy of a 2,000-tensor model took ~130 ns of interpreter per tensor
    otherwise, more than the bytes. A plan of `SHARED_COPY_MIN` bytes or more is shared
    among `COPY_THREADS` threads unless one copy is over `SHARED_COPY_MAX` (memcpy streams
    that one itself), and a shared plan of `STREAM_COPY_MIN` or more is streamed. Without
    the extension, each small copy is a memoryview assignment (`byte_view`) and each big
    one a ctypes.memmove (which drops the GIL). The caller vouches that every address
    holds its byte count while the plan is used, and that no two ranges overlap.
    """

    __slots__ = ("_native", "_plan", "_threads", "_stream", "_views", "_memmoves")

    def __init__(self, moves: Iterable[tuple[int, int, int]]) -> None:
        moves = [move for move in moves if move[2]]
        self._native = NATIVE_COPY
        self._plan = array("Q")  # the native loop's triples; the views and memmoves otherwise
        self._threads = 1
        self._stream = False
        self._views: list[tuple[memoryview, memoryview]] = []
        self._memmoves: list[tuple[int, int, int]] = []
        if self._native is not None:
            self._plan.extend(word for move in moves for word in move)
            sizes = [nbytes for _, _, nbytes in moves]
            if sizes and shares_copy(sizes):
                self._threads = COPY_THREADS
                self._stream = sum(sizes) >= STREAM_COPY_MIN
        else:
            for dst, src, nbytes in moves:
                if by_view(nbytes):
                    self._views.append((byte_view(dst, nbytes), byte_view(src, nbytes)))
                else:
                    self._memmoves.append((dst, src, nbytes))

    @property
    def threads(self) -> int:
        """How many threads one run uses."""
        return self._threads

    def run(self) -> None:
        if self._native is not None:
            self._native(self._plan, self._threads, self._stream)
            return
        for dst, src in self._views:
            dst[:] = src
        for dst_address, src_address, nbytes in self._memmoves:
            ctypes.memmove(dst_address, src_address, nbytes)  # releases the GIL


def bytes_are_values(tensor: torch.Tensor) -> bool:
    """Whether `tensor`'s memory, read as bytes from its data pointer, is its value: a
    contiguous CPU tensor without a lazy conj/neg bit. Only such a tensor may be copied
    by memmove."""
    return tensor.is_cpu and tensor.is_contiguous() and not tensor.is_conj() and not tensor.is_neg()


_Pairs = tuple[list[torch.Tensor], list[torch.Tensor]]


@dataclass(frozen=True)
class CopyPlan:
    """One slot's copies, grouped once: byte copies, one foreach, the rest one by one."""

    moved: list[torch.Tensor]  # the destinations copied as bytes
    addresses: list[int]  # where they were when planned
    byte_copies: ByteCopies
    small: _Pairs  # same device: one foreach
    other: _Pairs  # across devices (the CUDA transport's fallback), conj/neg: one by one

    @classmethod
    def of(
        cls,
        dsts: Mapping[Key, torch.Tensor],
        views: Mapping[Key, torch.Tensor],
        sliced: Iterable[tuple[torch.Tensor, list[tuple[int, int, int]]]] = (),
    ) -> CopyPlan:
        """`sliced`: destinations filled by byte copies planned elsewhere (a tensor-
        parallel worker's slices, `_shard_reads.slice_moves`), run in the same native
        call and revalidated like the others."""
        moved: list[torch.Tensor] = []
        moves: list[tuple[int, int, int]] = []
        for dst, more in sliced:
            moved.append(dst)
            moves.extend(more)
        small: _Pairs = ([], [])
        other: _Pairs = ([], [])
        for key, dst in dsts.items():
            src = views[key]
            if (
                bytes_are_values(dst)
                and bytes_are_values(src)
                and dst.dtype == src.dtype
                and dst.data_ptr() != 0  # an empty (freed) storage: let torch say so
            ):
                moved.append(dst)
                moves.append((dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size()))
            else:
                # foreach takes neither a conj/neg destination nor one on another device
                plain = not dst.is_conj() and not dst.is_neg()
                pairs = small if dst.device == src.device and plain else other
                pairs[0].append(dst)
                pairs[1].append(src)
        addresses = list(map(_DATA_PTR, moved))
        return cls(moved, addresses, ByteCopies(moves), small, other)

    def still_valid(self) -> bool:
        """Whether every byte-copy destination is still where the plan saw it.

        The destinations are this target's own detached aliases, so no one else can
        change their shape or strides; their storage, shared with the model, can still
        be resized (as FSDP does to free a parameter), and that moves or frees it.
        """
        return list(map(_DATA_PTR, self.moved)) == self.addresses

    def run(self) -> None:
        self.byte_copies.run()
        small, other = self.small, self.other
        if not small[0] and not other[0]:
            return
        with torch.no_grad():
            if small[0]:
                torch._foreach_copy_(*small)
            for dst_tensor, src_tensor in zip(*other, strict=True):
                dst_tensor.copy_(src_tensor)


_DATA_PTR: Callable[[torch.Tensor], int] = torch.Tensor.data_ptr


FOREACH_MAX = 1 << 20  # bytes: smaller CPU tensors are copied together by one foreach


@dataclass(frozen=True)
class WritePlan:
    """A slot's write, grouped once (see the module doc)."""

    gpu: list[tuple[Key, torch.Tensor]]  # tensors kept in a CUDA buffer
    small_keys: list[Key]  # CPU tensors copied together
    small_views: list[torch.Tensor]
    small_moves: list[ByteMove]  # the same, copied as bytes; [] if too many
    big: list[tuple[Key, torch.Tensor]]  # CPU tensors copied one by one (torch's threads)
    mirror: list[tuple[Key, torch.Tensor]]  # CPU copies of the CUDA tensors
    casts: Bf16Casts | None = None  # CPU bf16 views of a cast write: the native cast

    def run(self, flat: Mapping[Key, torch.Tensor], *, mirror: bool) -> None:
        """Copy `flat` (checked against the layout) to the slot; `mirror`: the CUDA
        tensors' CPU copies too. GPU copies are queued on the current streams."""
        sources = [flat[key] for key in self.small_keys]
        # A few small CPU tensors are copied as bytes: no dispatcher, no grad mode.
        if not (self.gpu or self.big or mirror or self.casts) and _write_bytes(
            sources, self.small_moves
        ):
            return
        left = self.casts.run(flat) if self.casts is not None else []
        with torch.no_grad():
            for view, source in left:  # what the native cast does not take: torch casts
                view.copy_(source)
            for key, view in self.gpu:  # device to device, queued on the current stream
                view.copy_(flat[key])
            if sources:
                try:
                    torch._foreach_copy_(self.small_views, sources)
                except RuntimeError:  # e.g. a tensor moved to another device since start
                    for view, source in zip(self.small_views, sources, strict=True):
                        view.copy_(source)
            for key, view in self.big:  # torch's threads: the trainer's cores are free
                view.copy_(flat[key])
            if mirror:
                for key, view in self.mirror:
                    view.copy_(flat[key])


@dataclass
class ByteMove:
    """Where one small tensor goes in a slot, and a byte view of the last source read."""

    address: int
    nbytes: int
    dst: memoryview | None  # the slot's bytes; None: copied by memmove
    src_address: int = 0
    src: memoryview | None = None

    @classmethod
    def to(cls, view: torch.Tensor) -> ByteMove:
        nbytes = view.numel() * view.element_size()
        dst = byte_view(view.data_ptr(), nbytes) if by_view(nbytes) else None
        return cls(view.data_ptr(), nbytes, dst)

    def copy(self, source: torch.Tensor) -> None:
        address = source.data_ptr()
        if self.dst is None:
            ctypes.memmove(self.address, address, self.nbytes)
            return
        if self.src is None or address != self.src_address:
            # the source's shape and dtype were checked: `nbytes` is what it holds
            self.src_address, self.src = address, byte_view(address, self.nbytes)
        self.dst[:] = self.src


def _write_bytes(sources: list[torch.Tensor], moves: list[ByteMove]) -> bool:
    """Write a few small CPU tensors to their places in the slot as bytes; False (nothing
    written) when there is no such plan or a source is not a plain contiguous CPU tensor.

    The publishing thread comes back to each publish with cold caches, after the workers
    ran (see `MEMMOVE_ALL_MAX`; the subscriber's copy plan does the same). Shapes and
    dtypes were checked against the layout.
    """
    if not moves or not all(map(bytes_are_values, sources)):
        return False
    for source, move in zip(sources, moves, strict=True):
        move.copy(source)
    return True


def write_plan(
    views: Mapping[Key, torch.Tensor],
    gpu: Mapping[Key, torch.Tensor] | None = None,
    *,
    cast: bool = False,
) -> WritePlan:
    """The copies of one slot, grouped once. `views`: the slot's CPU views of every
    tensor; `gpu`: the views of those kept in a CUDA buffer (their CPU views then hold
    the copies made for workers that read the CPU segment); `cast`: the sources have
    other dtypes than the slot (no byte copies: torch casts)."""
    gpu = gpu or {}
    small: list[tuple[Key, torch.Tensor]] = []
    big: list[tuple[Key, torch.Tensor]] = []
    bf16: list[tuple[Key, torch.Tensor]] = []
    for key, view in views.items():
        if key in gpu:
            continue
        if cast and NATIVE_CAST is not None and view.dtype == torch.bfloat16:
            bf16.append((key, view))
        elif view.numel() * view.element_size() >= FOREACH_MAX:
            big.append((key, view))
        else:
            small.append((key, view))
    mirror = [(key, views[key]) for key in gpu]
    moves = [ByteMove.to(v) for _, v in small] if len(small) <= MEMMOVE_ALL_MAX else []
    if cast:
        moves = []
    return WritePlan(
        list(gpu.items()),
        [k for k, _ in small],
        [v for _, v in small],
        moves,
        big,
        mirror,
        Bf16Casts(bf16) if bf16 else None,
    )
