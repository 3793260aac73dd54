"""Weights in, manifest and slot views out: `flatten`, `Layout`, `to_tensordict`.

No sockets, no shared memory: a slot here is a plain uint8 tensor.
"""

from __future__ import annotations

import time
from array import array

import pytest
import torch
from tensordict import TensorDict

import zmqsync
from zmqsync import _copy
from zmqsync._copy import BYTE_COPY_MAX, ByteCopies
from zmqsync._layout import (
    PAGE,
    Layout,
    flatten,
    to_tensordict,
    torch_dtype,
)
from zmqsync._protocol import ALIGN

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.int64,
    torch.bool,
    torch.complex64,
]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of `t`: equality that works for every dtype (fp8 and NaN included)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def _sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype == torch.int64:
        return torch.randint(-(2**40), 2**40, shape, generator=g)
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype, generator=g)
    return torch.randn(shape, generator=g).to(dtype)


def _slot(layout: Layout) -> torch.Tensor:
    return torch.zeros(layout.slot_bytes, dtype=torch.uint8)


def _write(layout: Layout, flat: dict) -> dict:
    """What the publisher does: copy every tensor into its view of a fresh slot."""
    views = layout.views(_slot(layout))
    for key, view in views.items():
        view.copy_(flat[key])
    return views


def _assert_aligned(layout: Layout) -> None:
    assert layout.slot_bytes % PAGE == 0 and layout.slot_bytes >= PAGE
    end = 0
    for spec in sorted(layout.specs, key=lambda s: s.offset):
        assert spec.offset % ALIGN == 0, spec
        assert spec.offset >= end, f"{spec.name} overlaps the tensor before it"
        end = spec.offset + spec.nbytes
    assert end <= layout.slot_bytes


# --- flatten: the three accepted kinds ------------------------------------------------


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Linear(3, 4)
        self.norm = torch.nn.BatchNorm1d(4)
        self.decoder = torch.nn.Linear(4, 3, bias=False)
        self.tied = torch.nn.Linear(4, 3, bias=False)
        self.tied.weight = self.decoder.weight
        self.register_buffer("cache", torch.ones(2), persistent=False)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))


def test_flatten_module_has_parameters_and_every_buffer_once():
    model = Net()
    flat = flatten(model)
    assert sorted(flat) == [
        ("cache",),
        ("decoder", "weight"),
        ("encoder", "bias"),
        ("encoder", "weight"),
        ("norm", "bias"),
        ("norm", "num_batches_tracked"),
        ("norm", "running_mean"),
        ("norm", "running_var"),
        ("norm", "weight"),
        ("steps",),
    ]
    assert ("tied", "weight") not in flat, "a tied weight travels once, under its first name"
    assert flat[("norm", "num_batches_tracked")].dtype == torch.int64
    assert flat[("cache",)].dtype == torch.float32, "non-persistent buffers travel too"


def test_flatten_module_shares_memory_and_detaches():
    model = Net()
    flat = flatten(model)
    weight = flat[("encoder", "weight")]
    assert weight.data_ptr() == model.encoder.weight.data_ptr()
    assert not weight.requires_grad
    assert flat[("norm", "running_var")].data_ptr() == model.norm.running_var.data_ptr()


def test_flatten_tensordict_uses_nested_keys():
    td = TensorDict(
        {"policy": {"mlp": {"w": torch.zeros(2, 3)}, "b": torch.zeros(3)}, "top": torch.ones(1)},
        batch_size=[],
    )
    flat = flatten(td)
    assert set(flat) == {("policy", "mlp", "w"), ("policy", "b"), ("top",)}
    assert flat[("policy", "mlp", "w")].shape == (2, 3)


def test_flatten_state_dict_splits_dotted_keys_like_a_module():
    model = Net()
    flat = flatten(model.state_dict())
    assert ("norm", "num_batches_tracked") in flat
    assert ("cache",) not in flat, "a state_dict has no non-persistent buffers"
    assert ("tied", "weight") in flat, "a state_dict lists tied weights under both names"
    assert flat[("encoder", "weight")].data_ptr() == model.encoder.weight.data_ptr()


def test_flatten_mapping_accepts_tuple_keys():
    flat = flatten({("a", "b"): torch.zeros(1), "c.d": torch.zeros(2)})
    assert set(flat) == {("a", "b"), ("c", "d")}


def test_flatten_tensordict_and_state_dict_agree():
    td = TensorDict({"a": {"b": torch.arange(3.0)}, "c": torch.ones(2)}, batch_size=[])
    sd = {"a.b": torch.arange(3.0), "c": torch.ones(2)}
    left, right = flatten(td), flatten(sd)
    assert set(left) == set(right)
    assert all(torch.equal(left[k], right[k]) for k in left)


@pytest.mark.parametrize(
    "weights",
    [None, 3, "weights", [torch.zeros(1)], (torch.zeros(1),), torch.zeros(3)],
    ids=["None", "int", "str", "list", "tuple", "tensor"],
)
def test_flatten_refuses_other_kinds_with_type_error(weights):
    with pytest.raises(TypeError, match="nn.Module, a TensorDict or a state_dict mapping"):
        flatten(weights)


def test_flatten_refuses_non_tensor_state_dict_entries():
    with pytest.raises(TypeError, match="'step' is a int, not a tensor"):
        flatten({"w": torch.zeros(1), "step": 3})
    with pytest.raises(TypeError, match="'nested' is a dict"):
        flatten({"nested": {"w": torch.zeros(1)}})


def test_flatten_refuses_nothing_to_publish():
    with pytest.raises(ValueError, match="no tensors"):
        flatten({})
    with pytest.raises(ValueError, match="no tensors"):
        flatten(torch.nn.ReLU())


def test_to_tensordict_round_trips_nested_keys_and_shares_tensors():
    flat = {("a", "b", "c"): torch.zeros(2), ("a", "d"): torch.ones(3), ("e",): torch.ones(())}
    td = to_tensordict(flat)
    assert set(td.keys(include_nested=True, leaves_only=True)) == {("a", "b", "c"), ("a", "d"), "e"}
    assert td["a", "b", "c"].data_ptr() == flat[("a", "b", "c")].data_ptr()
    assert flatten(td).keys() == flat.keys()


# --- Layout.of: dtypes, alignment, sizes ------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_round_trips_bit_exact_through_a_slot(dtype):
    flat = {("pad",): torch.ones(3, dtype=torch.uint8), ("x",): _sample(dtype, (5, 7))}
    layout = Layout.of(flat)
    _assert_aligned(layout)
    spec = layout.specs[1]
    assert spec.dtype == str(dtype).removeprefix("torch.")
    assert spec.nbytes == 35 * flat[("x",)].element_size()
    views = _write(layout, flat)
    got = views[("x",)]
    assert got.dtype == dtype and got.shape == (5, 7) and got.is_contiguous()
    assert torch.equal(_bits(got), _bits(flat[("x",)]))


def test_mixed_layout_offsets_are_aligned_and_slot_is_whole_pages():
    sizes = [1, 3, 255, 256, 257, 1000, 4095, 4097]
    flat = {(f"t{i}",): _sample(DTYPES[i % len(DTYPES)], (n,), seed=i) for i, n in enumerate(sizes)}
    layout = Layout.of(flat)
    _assert_aligned(layout)
    assert [s.key for s in layout.specs] == list(flat), "layout keeps the input order"
    assert layout.nbytes == sum(t.numel() * t.element_size() for t in flat.values())
    slot = _slot(layout)
    views = layout.views(slot)
    for spec in layout.specs:
        view = views[spec.key]
        assert (view.data_ptr() - slot.data_ptr()) == spec.offset
        assert view.data_ptr() % ALIGN == slot.data_ptr() % ALIGN


def test_slot_bytes_is_at_least_one_page_and_rounds_up():
    small = Layout.of({("a",): torch.zeros(1)})
    assert small.slot_bytes == PAGE
    exact = Layout.of({("a",): torch.zeros(PAGE // 4)})
    assert exact.slot_bytes == PAGE
    over = Layout.of({("a",): torch.zeros(PAGE // 4 + 1)})
    assert over.slot_bytes == 2 * PAGE


def test_layout_of_a_module_with_batchnorm():
    model = Net()
    layout = Layout.of(flatten(model))
    _assert_aligned(layout)
    by_name = {s.name: s for s in layout.specs}
    assert by_name["norm.num_batches_tracked"].dtype == "int64"
    assert by_name["norm.num_batches_tracked"].shape == ()
    assert by_name["encoder.weight"].shape == (4, 3)
    assert by_name["encoder.weight"].stride == (3, 1)


def test_layout_refuses_dtypes_the_wire_cannot_name():
    with pytest.raises(TypeError, match=r"x: dtype torch.uint16 cannot be published"):
        Layout.of({("x",): torch.zeros(2, dtype=torch.uint16)})


def test_torch_dtype_is_a_fixed_table():
    assert torch_dtype("bfloat16") is torch.bfloat16
    assert torch_dtype("float8_e4m3fn") is torch.float8_e4m3fn
    for bad in ("Tensor", "nn", "__class__", "float"):
        with pytest.raises(zmqsync.LayoutMismatch, match="not supported"):
            torch_dtype(bad)


def test_zero_size_and_zero_dim_tensors():
    flat = {
        ("empty",): torch.zeros(0, 3),
        ("scalar",): torch.tensor(2.5),
        ("empty_int",): torch.zeros(0, dtype=torch.int64),
        ("count",): torch.tensor(7, dtype=torch.int64),
        ("flag",): torch.tensor(True),
    }
    layout = Layout.of(flat)
    _assert_aligned(layout)
    by_name = {s.name: s for s in layout.specs}
    assert by_name["empty"].nbytes == 0 and by_name["empty"].shape == (0, 3)
    assert by_name["scalar"].shape == () and by_name["scalar"].nbytes == 4
    views = _write(layout, flat)
    assert views[("empty",)].shape == (0, 3)
    assert views[("scalar",)].shape == () and views[("scalar",)].item() == 2.5
    assert views[("count",)].item() == 7
    assert views[("flag",)].item() is True
    assert views[("empty_int",)].numel() == 0


def test_only_zero_size_tensors_still_make_a_page():
    layout = Layout.of({("a",): torch.zeros(0), ("b",): torch.zeros(0, 4)})
    assert layout.slot_bytes == PAGE and layout.nbytes == 0
    assert all(s.offset == 0 for s in layout.specs)


# --- non-contiguous sources -------------------------------------------------------------


def test_non_contiguous_sources_copy_to_equal_values():
    base = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    bf = torch.randn(8, 6).to(torch.bfloat16)
    flat = {
        ("transposed",): base.t(),
        ("sliced",): base[1:5, ::3],
        ("column",): base[:, 2],
        ("expanded",): torch.tensor([1.5]).expand(4, 3),
        ("bf16_t",): bf.t(),
        ("fp8_t",): torch.randn(3, 5).to(torch.float8_e4m3fn).t(),
        ("int_rev",): torch.arange(10, dtype=torch.int64).flip(0)[::2],
    }
    assert not any(t.is_contiguous() for t in flat.values())
    layout = Layout.of(flat)
    _assert_aligned(layout)
    for spec in layout.specs:
        assert spec.stride == tuple(torch.empty(spec.shape).stride()), spec.name
    views = _write(layout, flat)
    for key, source in flat.items():
        assert views[key].shape == source.shape
        assert torch.equal(_bits(views[key]), _bits(source)), key


def test_views_alias_the_slot():
    flat = {("a",): torch.zeros(4), ("b",): torch.zeros(2, 2, dtype=torch.int64)}
    layout = Layout.of(flat)
    slot = _slot(layout)
    views = layout.views(slot)
    views[("b",)].fill_(-1)
    spec = layout.specs[1]
    assert bool((slot[spec.offset : spec.offset + spec.nbytes] == 255).all())
    assert int(slot[: spec.offset].sum()) == 0


# --- Layout.check -----------------------------------------------------------------------


@pytest.fixture
def layout() -> Layout:
    return Layout.of(
        {
            ("a",): torch.zeros(4),
            ("b", "c"): torch.zeros(2, 3),
            ("d",): torch.zeros(5, dtype=torch.int64),
        }
    )


def _same():
    return {
        ("a",): torch.ones(4),
        ("b", "c"): torch.ones(2, 3),
        ("d",): torch.ones(5, dtype=torch.int64),
    }


def test_check_accepts_the_same_keys_shapes_and_dtypes(layout):
    layout.check(_same())
    reordered = dict(reversed(list(_same().items())))
    layout.check(reordered)
    strided = {**_same(), ("b", "c"): torch.ones(3, 2).t(), ("a",): torch.ones(8)[::2]}
    assert not strided[("b", "c")].is_contiguous()
    layout.check(strided)


def test_check_names_a_missing_key(layout):
    flat = _same()
    del flat[("b", "c")]
    with pytest.raises(zmqsync.LayoutMismatch, match="missing key 'b.c'") as exc:
        layout.check(flat)
    assert isinstance(exc.value, ValueError)
    assert "start a new Publisher" in str(exc.value)


def test_check_names_the_first_missing_key_before_an_extra_one(layout):
    flat = _same()
    del flat[("a",)], flat[("d",)]
    flat[("zzz",)] = torch.zeros(1)
    with pytest.raises(zmqsync.LayoutMismatch, match="missing key 'a'"):
        layout.check(flat)


def test_check_names_an_extra_key(layout):
    with pytest.raises(zmqsync.LayoutMismatch, match="unexpected key 'b.e'"):
        layout.check({**_same(), ("b", "e"): torch.zeros(1), ("f",): torch.zeros(1)})


def test_check_names_a_shape_difference(layout):
    flat = _same()
    flat[("b", "c")] = torch.zeros(3, 2)
    with pytest.raises(
        zmqsync.LayoutMismatch, match=r"b.c: got float32\[3, 2\], the bus carries float32\[2, 3\]"
    ):
        layout.check(flat)


def test_check_names_a_dtype_difference(layout):
    flat = _same()
    flat[("d",)] = torch.zeros(5, dtype=torch.int32)
    with pytest.raises(zmqsync.LayoutMismatch, match=r"d: got int32\[5\], the bus carries int64"):
        layout.check(flat)
    flat[("d",)] = torch.zeros(5, dtype=torch.uint16)
    with pytest.raises(zmqsync.LayoutMismatch, match=r"d: got torch.uint16\[5\]"):
        layout.check(flat)


def test_check_reports_the_first_difference_in_layout_order(layout):
    flat = _same()
    flat[("a",)] = torch.zeros(5)
    flat[("d",)] = torch.zeros(5, dtype=torch.float32)
    with pytest.raises(zmqsync.LayoutMismatch, match=r"^a: got float32\[5\]"):
        layout.check(flat)


def test_check_zero_dim_against_one_element(layout):
    scalar = Layout.of({("s",): torch.tensor(1.0)})
    scalar.check({("s",): torch.tensor(3.0)})
    with pytest.raises(zmqsync.LayoutMismatch, match=r"s: got float32\[1\], the bus carries"):
        scalar.check({("s",): torch.ones(1)})


def test_check_is_linear_in_the_number_of_tensors():
    flat = {(f"layer{i}", "w"): torch.zeros(1) for i in range(6000)}
    layout = Layout.of(flat)
    start = time.perf_counter()
    layout.check(flat)
    assert time.perf_counter() - start < 0.25, "6000 tensors take ~5 ms when linear"


def test_the_native_copy_loop_is_built():
    """The README's install compiles it (gcc is part of this machine's setup). Without it
    every copy still works, from Python, and a 2,000-tensor worker spends ~50% more CPU
    per version (docs/benchmarks.md): a silent fallback here would go unnoticed."""
    assert _copy.NATIVE_COPY is not None, "zmqsync._native was not built: pip install -e ."


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_byte_copies_write_exactly_the_planned_ranges(monkeypatch, native):
    if not native:
        monkeypatch.setattr(_copy, "NATIVE_COPY", None)
    sizes = [0, 1, 7, 4096, BYTE_COPY_MAX, BYTE_COPY_MAX + 1, 3 << 20]
    sources = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in sizes]
    targets = [torch.zeros(n + 16, dtype=torch.uint8) for n in sizes]  # 8 guard bytes a side
    copies = ByteCopies(
        (t.data_ptr() + 8, s.data_ptr(), n) for t, s, n in zip(targets, sources, sizes, strict=True)
    )
    for _ in range(2):  # a plan is addresses: run again, it copies what they hold now
        copies.run()
        for target, source, n in zip(targets, sources, sizes, strict=True):
            assert torch.equal(target[8 : 8 + n], source), n
            assert not target[:8].any() and not target[8 + n :].any(), n
        for source in sources:
            source.random_(0, 256)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("ranges", ["few", "many"])
@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_a_native_copy_shared_among_threads_writes_exactly_the_planned_ranges(
    threads, ranges, stream
):
    """The helpers take 512 KiB chunks of the plan's bytes: chunks start and end inside
    ranges, ranges (0 and 1 byte among them) fall inside one chunk, and with thousands of
    ranges each chunk finds its first one by a search. Streamed (non-temporal stores from
    the destination's 32-byte boundary, the unaligned head and tail by memmove), the
    bytes are memmove's: the destinations start 8 bytes into their buffers, the sources
    3 bytes in."""
    copy_many = _copy.NATIVE_COPY
    assert copy_many is not None
    if ranges == "few":
        sizes = [(1 << 20) + 3, 0, 1, 5, (512 << 10) - 1, 3 << 20, 77, (2 << 20) + 1]
    else:
        sizes = torch.randint(0, 2500, (3000,), generator=torch.Generator().manual_seed(7)).tolist()
    buffers = [torch.randint(0, 256, (n + 3,), dtype=torch.uint8) for n in sizes]
    sources = [b[3:] for b in buffers]
    targets = [torch.zeros(n + 16, dtype=torch.uint8) for n in sizes]  # 8 guard bytes a side
    plan = array("Q")
    for t, s, n in zip(targets, sources, sizes, strict=True):
        plan.extend((t.data_ptr() + 8, s.data_ptr(), n))
    for _ in range(3):
        copy_many(plan, threads, stream)
        for target, source, n in zip(targets, sources, sizes, strict=True):
            assert torch.equal(target[8 : 8 + n], source), n
            assert not target[:8].any() and not target[8 + n :].any(), n
        for buffer in buffers:
            buffer.random_(0, 256)


def test_byte_copies_share_only_a_big_plan_among_threads(monkeypatch):
    monkeypatch.setattr(_copy, "COPY_THREADS", 3)
    big = [torch.zeros(_copy.SHARED_COPY_MIN // 2, dtype=torch.uint8) for _ in range(4)]
    plan = [(big[0].data_ptr(), big[1].data_ptr(), big[0].numel())]
    assert ByteCopies(plan).threads == 1
    plan.append((big[2].data_ptr(), big[3].data_ptr(), big[2].numel()))
    big[3].fill_(9)
    copies = ByteCopies(plan)
    assert copies.threads == 3
    copies.run()
    assert bool((big[2] == 9).all())
    monkeypatch.setattr(_copy, "NATIVE_COPY", None)
    assert ByteCopies(plan).threads == 1, "the Python fallback copies on this thread"


def test_byte_copies_share_stream_or_copy_whole_as_the_plan_says(monkeypatch):
    """A plan holding a copy over SHARED_COPY_MAX runs whole on one thread (glibc's
    memcpy streams a copy that big; a shared copy's pieces never would); a shared plan of
    STREAM_COPY_MIN bytes or more is written with non-temporal stores. The bytes arrive
    every way."""
    calls: list[tuple[int, bool]] = []
    native = _copy.NATIVE_COPY
    assert native is not None

    def recording(plan: array, threads: int, stream: bool) -> None:
        calls.append((threads, stream))
        native(plan, threads, stream)

    monkeypatch.setattr(_copy, "NATIVE_COPY", recording)
    monkeypatch.setattr(_copy, "COPY_THREADS", 3)
    monkeypatch.setattr(_copy, "SHARED_COPY_MIN", 1 << 10)
    monkeypatch.setattr(_copy, "SHARED_COPY_MAX", 1 << 20)
    monkeypatch.setattr(_copy, "STREAM_COPY_MIN", 2 << 20)
    src = torch.randint(0, 256, (5 << 20,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    mib = 1 << 20
    cases = [
        ([100], (1, False)),  # small: one thread
        ([1 << 10], (3, False)),  # shared
        ([mib] * 2, (3, True)),  # shared and streamed
        ([mib, mib + 1], (1, False)),  # one copy past SHARED_COPY_MAX: whole
        ([(3 * mib) + 5], (1, False)),
    ]
    for sizes, expected in cases:
        dst.zero_()
        moves, at = [], 0
        for n in sizes:
            moves.append((dst.data_ptr() + at, src.data_ptr() + at, n))
            at += n
        calls.clear()
        copies = ByteCopies(moves)
        assert copies.threads == expected[0], sizes
        copies.run()
        assert calls == [expected], sizes
        assert torch.equal(dst[:at], src[:at]) and not dst[at:].any(), sizes


@pytest.mark.parametrize(
    ("setting", "expected"), [("1", 1), ("3", 3), ("64", 64), ("0", None), ("two", None)]
)
def test_copy_threads_come_from_the_environment(monkeypatch, setting, expected):
    monkeypatch.setenv("ZMQSYNC_COPY_THREADS", setting)
    if expected is None:
        with pytest.raises(ValueError, match="ZMQSYNC_COPY_THREADS"):
            _copy._copy_threads()
    else:
        assert _copy._copy_threads() == expected
    monkeypatch.delenv("ZMQSYNC_COPY_THREADS")
    assert 1 <= _copy._copy_threads() <= 4


def test_the_native_copy_refuses_a_plan_that_is_not_whole_triples():
    copy_many = _copy.NATIVE_COPY
    assert copy_many is not None
    with pytest.raises(ValueError, match="triples"):
        copy_many(array("Q", [1, 2]))  # refused before any address is touched
    with pytest.raises(TypeError):
        copy_many(12)  # type: ignore[arg-type]
    copy_many(array("Q"))  # nothing to copy
    for threads in (0, 65):
        with pytest.raises(ValueError, match="threads"):
            copy_many(array("Q"), threads)
