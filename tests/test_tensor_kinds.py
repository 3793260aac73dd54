"""Tensors no slot can hold get a one-line error naming them, on either side, never a
crash: a subclass, a quantized, nested or sparse tensor, a meta or fake tensor."""

from __future__ import annotations

import warnings

import pytest
import torch

import zmqsync

pytestmark = pytest.mark.timeout(60)


def _odd() -> dict[str, torch.Tensor]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with warnings.catch_warnings():  # prototype and deprecation notices of torch
        warnings.simplefilter("ignore")
        made = {
            "meta": (torch.empty(3, device="meta"), "meta device"),
            "quantized": (
                torch.quantize_per_tensor(torch.rand(4), 0.1, 0, torch.quint8),
                "quantized",
            ),
            "nested": (torch.nested.nested_tensor([torch.rand(2), torch.rand(3)]), "nested"),
            "jagged": (
                torch.nested.nested_tensor([torch.rand(2), torch.rand(3)], layout=torch.jagged),
                "nested",
            ),
            "sparse": (torch.rand(3, 3).to_sparse(), "sparse_coo"),
        }
        with FakeTensorMode():
            made["fake"] = (torch.empty(3), "FakeTensor")
    return made


class _Wrapper(torch.Tensor):
    """A tensor subclass of a user's own."""


@pytest.mark.parametrize("kind", ["meta", "quantized", "nested", "jagged", "sparse", "fake"])
def test_the_publisher_names_the_tensor_in_one_line(kind, name):
    tensor, what = _odd()[kind]
    with pytest.raises(TypeError) as info:
        zmqsync.Publisher({"ok": torch.zeros(2), "head.w": tensor}, name=name)
    message = str(info.value)
    assert message.startswith("'head.w' ") and what in message and "\n" not in message


def test_a_subclass_of_the_users_own_is_named_with_its_type(name):
    odd = torch.zeros(3).as_subclass(_Wrapper)
    with pytest.raises(TypeError, match=r"^'w' is a .*_Wrapper, a tensor subclass"):
        zmqsync.Publisher({"w": odd}, name=name)


def test_a_publish_given_a_subclass_is_refused_before_any_copy(name):
    with zmqsync.Publisher({"w": torch.zeros(3)}, name=name, timeout=5) as pub:
        with pytest.raises(TypeError, match=r"^'w' is a .*_Wrapper"):
            pub.publish(weights={"w": torch.ones(3).as_subclass(_Wrapper)})
        pub.publish(weights={"w": torch.ones(3)})  # the publisher goes on
        assert pub.version == 1


def test_a_worker_whose_model_is_on_the_meta_device_is_told_which_tensor(name):
    with zmqsync.Publisher(torch.nn.Linear(3, 2), name=name, timeout=5):
        model = torch.nn.Linear(3, 2, device="meta")
        sub = zmqsync.Subscriber(name=name, model=model, timeout=5)
        with pytest.raises(TypeError, match=r"^'weight' is on the meta device"):
            sub.start()
        sub.close()


def test_dtensor_cases_in_a_world_of_one_rank(spawn, name):
    """A Partial placement, writes other than Copy(), keys=: each named in one line; a
    one-rank mesh publishes as any bus, and a worker's DTensor takes its slice
    (`tests/helpers/one_rank_dtensors.py`)."""
    proc = spawn("tests/helpers/one_rank_dtensors.py", name, module="")
    assert proc.finish(120) == 0, proc.stderr[-3000:]
    got = {r["case"]: r for r in proc.records}
    assert got["partial"]["error"].startswith("TypeError: 'w' is a DTensor with placement P(sum)")
    assert got["live"]["error"].startswith("NotImplementedError: DTensor weights are written")
    assert "publish(keys=...) is not supported" in got["keys"]["error"]
    assert got["one-rank"] == {
        "case": "one-rank",
        "error": None,
        "version": 1,
        "applied": True,
        "same": True,
    }
    assert got["worker"] == {"case": "worker", "error": None, "took": True}
    assert got["alias-dict"]["error"] == (
        "TypeError: 'w' is a DTensor in a dict: alias mode binds the DTensors of an "
        "nn.Module; pass the module, or use Copies()"
    )
    assert got["alias-module"] == {"case": "alias-module", "error": None, "took": True,
                                   "view": True}  # fmt: skip
    assert all("\n" not in (r["error"] or "") for r in got.values())
