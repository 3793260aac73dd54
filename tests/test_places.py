"""A flat publish's check of its tensors' addresses: the C++ `at` and its Python twin.

Both must give the same answer for the same owners, names and addresses, whatever the
entries hold: tensors where they should be or elsewhere, Parameters, views, missing
entries, None, other objects, and tensors with no data pointer (sparse, a subclass
without storage), for which torch's function throws a C++ exception the C++ catches.
Then the reader and a publisher that use it: a tensor re-pointed with ``.data =`` is
seen at the next publish.

ZMQSYNC_REQUIRE_NATIVE=1 (as CI sets it) turns a missing extension into a failure here.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import zmqsync
from tests.helpers import native
from zmqsync import _places
from zmqsync._layout import ModuleReader
from zmqsync._places import Places, at_reference, pack


class NoStorage(torch.Tensor):
    """A wrapper subclass: a tensor with no storage, whose data pointer torch refuses."""

    @staticmethod
    def __new__(cls) -> NoStorage:
        return torch.Tensor._make_wrapper_subclass(cls, (2,), dtype=torch.float32)  # type: ignore[attr-defined]

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise NotImplementedError(str(func))


class Plain(torch.Tensor):
    """A subclass with storage, as a user's tensor type may be."""


def _native_at() -> Any:
    if _places.NATIVE_AT is None:
        native.missing(
            "the C++ address check is not in use (zmqsync._places_native not "
            "built, or ZMQSYNC_NATIVE=0)"
        )
    return _places.NATIVE_AT


with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # sparse invariant checks: not what is tested
    _SPARSE = torch.sparse_coo_tensor([[0]], [1.0], (2,))
_BASE = torch.arange(16, dtype=torch.float32)
_PARAM = torch.nn.Parameter(torch.ones(4))
_PLAIN = torch.ones(3).as_subclass(Plain)

# What an entry can be: (the object, whether it is a tensor at its own data pointer)
ENTRIES: dict[str, tuple[Any, bool]] = {
    "tensor": (_BASE, True),
    "view": (_BASE[5:9], True),
    "parameter": (_PARAM, True),
    "subclass": (_PLAIN, True),
    "empty": (torch.empty(0), True),
    "meta": (torch.empty(3, device="meta"), True),
    "sparse": (_SPARSE, False),
    "no storage": (NoStorage(), False),
    "none": (None, False),
    "int": (7, False),
    "text": ("tensor", False),
}


def _address(obj: Any) -> int:
    return torch.Tensor.data_ptr(obj)


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[list[Any], list[str], bytes, bool]:
    """Owners, names, addresses and the truth: every entry a tensor at its address."""
    kinds = draw(st.lists(st.sampled_from(sorted(ENTRIES)), max_size=8))
    owners: list[Any] = []
    names: list[str] = []
    addresses: list[int] = []
    truth = True
    for i, kind in enumerate(kinds):
        obj, has_address = ENTRIES[kind]
        owner: Any = {f"t{i}": obj}
        names.append(f"t{i}")
        address = _address(obj) if has_address else 4096
        if has_address and draw(st.booleans()):  # the tensor is elsewhere
            address += draw(st.sampled_from([1, 8, 1 << 20, 1 << 62]))
            truth = False
        truth = truth and has_address
        if draw(st.integers(0, 9)) == 0:  # the entry is gone
            del owner[f"t{i}"]
            truth = False
        if draw(st.integers(0, 19)) == 0:  # not a dict
            owner = [obj]
            truth = False
        owners.append(owner)
        addresses.append(address)
    packed = pack(addresses)
    cut = draw(st.sampled_from(["", "names", "addresses"]))
    if cut == "names" and names:
        names.pop()
        truth = False
    elif cut == "addresses" and addresses:
        packed = packed[:-8]
        truth = False
    return owners, names, packed, truth


@settings(max_examples=500, deadline=None)
@given(scenarios())
def test_the_cpp_check_and_its_python_twin_agree(scenario):
    owners, names, addresses, truth = scenario
    assert at_reference(owners, names, addresses) is truth
    assert _native_at()(owners, names, addresses) is truth


def test_the_cpp_check_refuses_arguments_of_the_wrong_types():
    _native_at()
    from zmqsync._places_native import at

    with pytest.raises(TypeError):
        at(1, ({},), [], b"")
    with pytest.raises(ValueError):
        at(0, [], [], b"")


def test_the_check_is_the_cpp_one_where_it_is_built():
    assert _places.at is _native_at()


def _native_still_at() -> Any:
    _native_at()
    if _places.NATIVE_STILL_AT is None:
        native.missing("the remembered check is not in use (this Python's dicts have no tags)")
    return _places.NATIVE_STILL_AT


# What a trainer (or anything else) can do to a module's dicts and tensors between two
# checks. Each takes (owners, tensors, spare) and changes one thing.
def _repoint(owners, tensors, spare):
    tensors[0].data = spare  # same object, elsewhere: no dict changes


def _restore(owners, tensors, spare):
    tensors[0].data = _BASE[0:4]


def _replace_elsewhere(owners, tensors, spare):
    owners[1]["b"] = spare


def _replace_same_place(owners, tensors, spare):
    owners[1]["b"] = _BASE[4:8]  # another object at the address the check wants


def _put_back(owners, tensors, spare):
    owners[1]["b"] = tensors[1]


def _delete(owners, tensors, spare):
    owners[0].pop("a", None)


def _reinsert(owners, tensors, spare):
    owners[0]["a"] = tensors[0]


def _set_again(owners, tensors, spare):
    owners[0]["c"] = owners[0].get("c", tensors[2])


def _unrelated(owners, tensors, spare):
    owners[1]["other"] = spare


def _to_none(owners, tensors, spare):
    owners[0]["c"] = None


def _no_change(owners, tensors, spare):
    pass


_CHANGES = [
    _repoint,
    _restore,
    _replace_elsewhere,
    _replace_same_place,
    _put_back,
    _delete,
    _reinsert,
    _set_again,
    _unrelated,
    _to_none,
    _no_change,
]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_CHANGES), max_size=12))
def test_the_remembered_check_answers_as_the_lookups_do(changes):
    tensors = [_BASE[0:4].clone().view(4), _BASE[4:8], _BASE[8:12]]
    tensors[0].data = _BASE[0:4]  # a view of the base, as the other two
    owners: list[Any] = [{"a": tensors[0], "c": tensors[2]}, {"b": tensors[1]}]
    owners = [owners[0], owners[1], owners[0]]
    names = ["a", "b", "c"]
    addresses = pack([t.data_ptr() for t in tensors])
    spare = torch.zeros(4)
    places = Places(owners, names)
    assert places.at(addresses) is at_reference(owners, names, addresses) is True
    for change in changes:
        change(owners, tensors, spare)
        assert places.at(addresses) is at_reference(owners, names, addresses), change.__name__


def test_a_changed_dict_makes_the_remembered_check_look_up_again():
    versions, still_at = _native_still_at()
    probe = torch.zeros(2)
    owner: dict[str, Any] = {"p": probe}
    where = pack([probe.data_ptr()])
    tags = versions([owner])
    assert still_at([owner], tags, [probe], where)
    owner["q"] = 1  # any change, even to another entry
    assert not still_at([owner], tags, [probe], where)
    tags = versions([owner])
    del owner["q"]
    assert not still_at([owner], tags, [probe], where)
    tags = versions([owner])
    assert not still_at([owner], tags, [probe], pack([probe.data_ptr() + 4]))
    assert not still_at([owner], tags[:-1], [probe], where), "tags of another length"
    assert not still_at([owner], tags, [probe, probe], where), "objects of another length"
    assert versions([owner, [probe]]) is None, "not a dict: no tags"


def test_the_remembered_check_refuses_arguments_of_the_wrong_types():
    _native_still_at()
    from zmqsync._places_native import still_at, versions

    with pytest.raises(TypeError):
        versions(({},))
    with pytest.raises(TypeError):
        still_at(1, [], b"", (), b"")
    with pytest.raises(ValueError):
        still_at(0, [], b"", [], b"")


class Blocks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(3, 2)
        self.b = torch.nn.ModuleList(torch.nn.LayerNorm(2) for _ in range(3))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))


def test_the_reader_checks_what_it_would_read():
    model = Blocks()
    reader = ModuleReader(model)
    read = reader.read()
    where = pack([t.data_ptr() for t in read.values()])
    assert reader.at(where)
    weight = model.b[1].weight
    held = weight.data
    weight.data = torch.ones(2)  # re-pointed: no registration hook fires
    assert not reader.at(where)
    weight.data = held
    assert reader.at(where)
    model.c = torch.nn.Linear(1, 1)  # registered: the reader walks again before it answers
    assert not reader.at(where)
    reader.read()
    assert not reader.at(where), "a new tensor: the addresses are not the module's any more"


def test_a_flat_publish_sees_a_re_pointed_parameter(name, caplog):
    model = Blocks()
    worker_model = Blocks()
    with (
        zmqsync.Publisher(model, name=name, writes=zmqsync.Copy(flat=True), timeout=20) as pub,
        zmqsync.Subscriber(name=name, model=worker_model) as sub,
    ):
        assert pub.wait_for_workers(1, timeout=20)
        pub.publish()
        with torch.no_grad():
            model.a.weight.data = torch.full((2, 3), 5.0)  # leaves the block
            model.b[2].bias.fill_(3.0)  # in the block
        with caplog.at_level("WARNING", logger="zmqsync"):
            pub.publish()
        assert "left the flat layout (a.weight)" in caplog.text
        assert sub.wait_for_version(pub.version, timeout=20)
        assert torch.equal(worker_model.a.weight, torch.full((2, 3), 5.0))
        assert torch.equal(worker_model.b[2].bias, torch.full((2,), 3.0))


def test_the_reader_remembers_its_lookups_while_no_dict_changes():
    _native_still_at()
    model = Blocks()
    owners = [model.a._parameters, model.a._parameters]
    names = ["weight", "bias"]
    where = pack([model.a.weight.data_ptr(), model.a.bias.data_ptr()])
    places = Places(owners, names)
    assert not places.remembers
    assert places.at(where) and places.remembers
    model.a.weight.data = torch.ones(2, 3)
    assert not places.at(where), "re-pointed in place: its data pointer is checked"
    assert not places.remembers
    model.a.weight = torch.nn.Parameter(torch.ones(2, 3))
    assert not places.at(where)
    where = pack([model.a.weight.data_ptr(), model.a.bias.data_ptr()])
    assert places.at(where) and places.remembers, "a new Parameter, at its new place"
