"""The native float32 -> bf16 cast (``_cast.c``) against its reference, torch's cast.

Differential: every instruction set this CPU runs, plain and streaming stores, one
thread and a few, over special values (zeros, infinities, NaNs of every sign and
payload, subnormals, rounding ties both ways, values that round to infinity), every
high half-word with the low half-words that decide the rounding, random bit patterns,
and every length and alignment near the vector widths; bit for bit, with guard bytes
around each destination. Then the publisher's write of a bf16 slot (`write_plan`) with
the native cast and without it.
"""

from __future__ import annotations

from array import array

import pytest
import torch

from tests.helpers import native
from zmqsync import _copy
from zmqsync._copy import write_plan
from zmqsync._layout import Layout

_native = native.module(at_module_level=True)
ISAS = list(_native.cast_isas())


def _floats(bits: list[int] | torch.Tensor) -> torch.Tensor:
    """float32 values with exactly these bit patterns."""
    words = torch.as_tensor(bits, dtype=torch.int64)
    return (words & 0xFFFFFFFF).to(torch.int64).to(torch.int32).view(torch.float32)


def _special() -> torch.Tensor:
    bits = [0x00000000, 0x80000000, 0x7F800000, 0xFF800000]  # zeros, infinities
    bits += [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FBFFFFF, 0x7FFFFFFF]  # NaNs
    bits += [0xFFFFFFFF, 0x7FC0FFFF, 0x7F808000]  # NaNs whose low half would round
    bits += [0x00000001, 0x80000001, 0x007FFFFF, 0x807FFFFF, 0x00008000, 0x00018000]
    bits += [0x00010000, 0x00007FFF, 0x00800000, 0x80800000]  # subnormals, smallest normal
    bits += [0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001, 0xBF808000, 0xBF818000]  # ties
    bits += [0x7F7F8000, 0x7F7F7FFF, 0x7F7FFFFF, 0xFF7F8000, 0xFF7FFFFF]  # round to inf
    bits += [0x3F800000, 0x40490FDB, 0xC0490FDB, 0x33800000]
    return _floats(bits)


def _grid() -> torch.Tensor:
    """Every high half-word with the low half-words that decide the rounding."""
    high = torch.arange(1 << 16, dtype=torch.int64) << 16
    lows = torch.tensor([0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=torch.int64)
    return _floats((high[:, None] | lows[None, :]).reshape(-1))


def _random_bits(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return _floats(torch.randint(0, 1 << 32, (n,), generator=g, dtype=torch.int64))


def _reference(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.bfloat16).view(torch.int16)


def _cast(values: torch.Tensor, *, threads: int = 1, stream: bool = False, isa=None, pad=16):
    """The native cast of `values` into a fresh buffer, `pad` guard values a side,
    checked untouched; returns the cast values' bits."""
    out = torch.full((values.numel() + 2 * pad,), 0x5A5A, dtype=torch.int16)
    plan = array("Q", [out.data_ptr() + 2 * pad, values.data_ptr(), values.numel()])
    _native.cast_bf16(plan, threads, stream, isa)
    guard = torch.full((pad,), 0x5A5A, dtype=torch.int16)
    assert torch.equal(out[:pad], guard) and torch.equal(out[pad + values.numel() :], guard)
    return out[pad : pad + values.numel()]


def _assert_same(got: torch.Tensor, values: torch.Tensor) -> None:
    expected = _reference(values)
    if not torch.equal(got, expected):
        at = int((got != expected).nonzero()[0])
        bits = int(values.view(torch.int32)[at]) & 0xFFFFFFFF
        raise AssertionError(
            f"value {at} (bits {bits:#010x}): cast {int(got[at]) & 0xFFFF:#06x}, "
            f"torch {int(expected[at]) & 0xFFFF:#06x}"
        )


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("isa", ISAS)
def test_special_values_cast_as_torch_casts_them(isa, stream):
    values = _special()
    for shift in range(17):  # each value in every lane, and in the one-at-a-time tails
        rolled = torch.roll(torch.cat([values, values]), shift)
        _assert_same(_cast(rolled, isa=isa, stream=stream), rolled)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("isa", ISAS)
def test_every_high_half_word_rounds_as_torch_rounds_it(isa, stream):
    values = _grid()
    _assert_same(_cast(values, isa=isa, stream=stream), values)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("isa", ISAS)
def test_random_bit_patterns_cast_as_torch_casts_them(isa, threads):
    values = _random_bits(3 * 128 * 1024 + 77, seed=threads)  # several pieces per thread
    for stream in (False, True):
        _assert_same(_cast(values, isa=isa, stream=stream, threads=threads), values)


@pytest.mark.parametrize("isa", ISAS)
def test_every_length_and_alignment_near_the_vector_widths(isa):
    values = _random_bits(200, seed=3)
    for start in range(19):  # sources and destinations off every alignment
        for n in list(range(40)) + [63, 64, 65, 127, 128, 129]:
            chunk = values[start : start + n]
            for stream in (False, True):
                for pad in (16, 17, 19):
                    _assert_same(_cast(chunk, isa=isa, stream=stream, pad=pad), chunk)


def test_a_plan_of_many_ranges_shared_among_threads():
    sizes = torch.randint(0, 3000, (500,), generator=torch.Generator().manual_seed(5)).tolist()
    sizes += [300_000, 1, 0, 140_000]
    sources = [_random_bits(n, seed=i) for i, n in enumerate(sizes)]
    targets = [torch.full((n + 16,), 0x5A5A, dtype=torch.int16) for n in sizes]
    plan = array("Q")
    for t, s, n in zip(targets, sources, sizes, strict=True):
        plan.extend((t.data_ptr() + 16, s.data_ptr(), n))
    for threads in (1, 2, 4):
        _native.cast_bf16(plan, threads, True)
        for t, s, n in zip(targets, sources, sizes, strict=True):
            _assert_same(t[8 : 8 + n], s)
            assert bool((t[:8] == 0x5A5A).all()) and bool((t[8 + n :] == 0x5A5A).all())


def test_the_cast_refuses_bad_arguments_before_touching_memory():
    with pytest.raises(ValueError, match="triples"):
        _native.cast_bf16(array("Q", [1, 2]))
    with pytest.raises(TypeError):
        _native.cast_bf16(12)
    for threads in (0, 65):
        with pytest.raises(ValueError, match="threads"):
            _native.cast_bf16(array("Q"), threads)
    with pytest.raises(ValueError, match="isa"):
        _native.cast_bf16(array("Q"), 1, False, "sse9")
    _native.cast_bf16(array("Q"))  # nothing to cast
    assert ISAS[-1] == "scalar" and len(set(ISAS)) == len(ISAS)


def _slot_views(flat):
    layout = Layout.of({k: torch.empty(t.shape, dtype=torch.bfloat16) for k, t in flat.items()})
    slot = torch.zeros(layout.slot_bytes, dtype=torch.uint8)
    return layout.views(slot)


@pytest.mark.parametrize("native_cast", [True, False])
def test_a_bf16_slot_write_holds_torchs_cast_of_every_tensor(monkeypatch, native_cast):
    """The publisher's write: float32 tensors (big and small, contiguous or not), a bf16
    one and an empty one into bf16 views, with the native cast and without it. (The
    transposed source has no NaN: torch's own strided cast writes them as 0x7FC0, its
    contiguous one as 0xFFFF; such a source is left to torch.)"""
    if not native_cast:
        monkeypatch.setattr(_copy, "NATIVE_CAST", None)
    big = _random_bits(5 << 20, seed=11).reshape(1024, -1)  # 20 MiB: shared among threads
    flat = {
        ("special",): _special(),
        ("grid",): _grid()[: 1 << 16],
        ("big",): big,
        ("transposed",): torch.randn(64, 48).t(),
        ("already",): _random_bits(100, seed=13).to(torch.bfloat16),
        ("empty",): torch.empty(0, 3),
    }
    views = _slot_views(flat)
    plan = write_plan(views, cast=True)
    assert (plan.casts is not None) == native_cast
    for _ in range(2):  # the plan is made again per run from the sources' addresses
        plan.run(flat, mirror=False)
        for key, source in flat.items():
            expected = source.to(torch.bfloat16).contiguous().reshape(-1).view(torch.int16)
            assert torch.equal(views[key].reshape(-1).view(torch.int16), expected), key
        big.mul_(-1.5)
