"""The transport decision, torch's IPC handle format and device UUIDs: pure, no GPU needed."""

from __future__ import annotations

import dataclasses
import itertools
import os

import pytest

from zmqsync._buffers.transport import (
    CPU_PUBLISHER,
    DISABLED,
    IPC_HANDLE_BYTES,
    NO_GPU,
    NOTE_MAX,
    Decision,
    Facts,
    choose_transport,
    expandable_segments,
    initial_transport,
    ipc_disabled,
    local_index,
    normalize_uuid,
    pid_namespace,
    raw_ipc_handle,
    registered,
)

UUID = "GPU-5f0c2a1e-8d7b-4c3a-9e21-0123456789ab"
OTHER = "GPU-0b6b8f2c-1111-2222-3333-444455556666"

# A CUDA worker on a bus whose GPU it can map: everything in order.
GOOD = Facts(
    prefers="cuda",
    cuda_available=True,
    publisher_cuda=True,
    has_handle=True,
    device_uuid=UUID,
    local_index=0,
    pid_ns=4026531836,
    publisher_pid_ns=4026531836,
)


# --- the decision ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prefers", "cuda", "disabled", "expected"),
    [
        ("cpu", True, False, Decision("cpu", "")),
        ("cpu", False, False, Decision("cpu", "")),
        ("cpu", True, True, Decision("cpu", "")),
        ("cuda", True, False, Decision("cuda", "")),
        ("any", True, False, Decision("cuda", "")),
        ("any", False, False, Decision("cpu", NO_GPU)),
        ("cuda", False, False, Decision("cpu", NO_GPU)),
        ("cuda", True, True, Decision("cpu", DISABLED)),
        ("any", True, True, Decision("cpu", DISABLED)),
    ],
)
def test_initial_transport(prefers, cuda, disabled, expected):
    assert initial_transport(prefers, cuda, disabled) == expected


def test_initial_transport_refuses_unknown_preference():
    with pytest.raises(ValueError, match="prefers"):
        initial_transport("gpu", True)


def test_good_facts_give_cuda():
    assert choose_transport(GOOD) == Decision("cuda", "")
    assert choose_transport(dataclasses.replace(GOOD, prefers="any")) == Decision("cuda", "")
    # unknown namespaces (0) do not block: the driver decides when the handle is opened
    assert choose_transport(dataclasses.replace(GOOD, pid_ns=0)).transport == "cuda"
    assert choose_transport(dataclasses.replace(GOOD, publisher_pid_ns=0)).transport == "cuda"


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"prefers": "cpu"}, None),
        ({"cuda_available": False}, "no GPU visible"),
        ({"ipc_disabled": True}, "ZMQSYNC_CUDA_IPC=0"),
        ({"has_handle": False, "ipc_note": "expandable segment"}, "expandable segment"),
        ({"has_handle": False}, "no reason given"),
        ({"local_index": None}, f"GPU {UUID} is not visible"),
        ({"publisher_pid_ns": 4026532000}, "another PID namespace"),
        ({"open_error": "RuntimeError: CUDA error: invalid argument"}, "invalid argument"),
    ],
    ids=repr,
)
def test_each_obstacle_falls_back_to_cpu_and_says_why(change, needle):
    decision = choose_transport(dataclasses.replace(GOOD, **change))
    assert decision.transport == "cpu"
    if needle is None:
        assert decision.reason == ""  # a CPU worker is not a fallback
    else:
        assert needle in decision.reason
        assert len(decision.reason) <= NOTE_MAX


def test_pid_namespace_reason_names_both_namespaces_and_the_fix():
    reason = choose_transport(dataclasses.replace(GOOD, publisher_pid_ns=7)).reason
    assert "pid:[7]" in reason and "pid:[4026531836]" in reason and "--pid=host" in reason


def test_obstacles_are_checked_in_order():
    """With several obstacles the first one in the documented order is the reason."""
    everything = dataclasses.replace(
        GOOD,
        has_handle=False,
        ipc_note="no pool",
        local_index=None,
        publisher_pid_ns=1,
        open_error="boom",
    )
    assert "no pool" in choose_transport(everything).reason
    assert (
        "not visible" in choose_transport(dataclasses.replace(everything, has_handle=True)).reason
    )
    assert (
        "namespace"
        in choose_transport(dataclasses.replace(everything, has_handle=True, local_index=0)).reason
    )


def test_long_reasons_are_cut_to_fit_the_message():
    reason = choose_transport(dataclasses.replace(GOOD, open_error="x" * 5000)).reason
    assert len(reason) == NOTE_MAX and reason.endswith("...")


def test_cpu_bus_always_gives_cpu():
    for prefers, cuda, disabled in itertools.product(("cuda", "cpu", "any"), (True, False), (1, 0)):
        facts = Facts(prefers=prefers, cuda_available=cuda, ipc_disabled=bool(disabled))
        assert choose_transport(facts).transport == "cpu"
    assert choose_transport(Facts("cuda", True)) == Decision("cpu", CPU_PUBLISHER)
    assert choose_transport(Facts("any", False)) == Decision("cpu", "")


def test_registered():
    assert registered("cuda", "", bus_has_cuda=False) == Decision("cpu", CPU_PUBLISHER)
    assert registered("cpu", NO_GPU, bus_has_cuda=False) == Decision("cpu", "")
    assert registered("cpu", "", bus_has_cuda=False) == Decision("cpu", "")
    assert registered("cuda", "", bus_has_cuda=True) == Decision("cuda", "")
    assert registered("cpu", "why", bus_has_cuda=True) == Decision("cpu", "why")
    assert len(registered("cpu", "y" * 999, bus_has_cuda=True).reason) == NOTE_MAX


@pytest.mark.parametrize("bus_has_cuda", [True, False])
@pytest.mark.parametrize("prefers", ["cuda", "cpu", "any"])
@pytest.mark.parametrize("cuda", [True, False])
@pytest.mark.parametrize("disabled", [True, False])
def test_a_second_hello_is_needed_only_after_a_cuda_probe_failed(
    bus_has_cuda, prefers, cuda, disabled
):
    """What the HELLO registers equals the decision unless a probe of the bus failed."""
    hello = initial_transport(prefers, cuda, disabled)
    facts = Facts(prefers, cuda, disabled, publisher_cuda=bus_has_cuda)
    good = dataclasses.replace(facts, has_handle=True, local_index=0, device_uuid=UUID)
    assert choose_transport(good) == registered(*hello, bus_has_cuda)
    bad = dataclasses.replace(good, open_error="refused")
    if bus_has_cuda and hello.transport == "cuda":
        assert choose_transport(bad) != registered(*hello, bus_has_cuda)
    else:
        assert choose_transport(bad) == registered(*hello, bus_has_cuda)


# --- torch's handle format ------------------------------------------------------------------

RAW = bytes(range(64))


@pytest.mark.parametrize("version", [1, 2, 3])
def test_versioned_cudamalloc_handle_gives_its_64_bytes(version):
    assert raw_ipc_handle(bytes([version]) + b"c" + RAW) == (RAW, "")


def test_bare_64_byte_handle_is_taken_as_is():
    assert raw_ipc_handle(RAW) == (RAW, "")
    assert IPC_HANDLE_BYTES == 64


def test_expandable_segment_handle_cannot_travel():
    handle, why = raw_ipc_handle(b"\x03e" + b"\x00" * 40)
    assert handle == b"" and "expandable" in why


@pytest.mark.parametrize(
    "data", [b"", b"\x03", b"\x03c" + RAW[:10], b"\x03c" + RAW + b"x", b"\x03z" + RAW]
)
def test_unknown_handle_formats_are_refused(data):
    handle, why = raw_ipc_handle(data)
    assert handle == b"" and "unknown torch IPC handle format" in why


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, False),
        ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, True),
        ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128, expandable_segments:true"}, True),
        ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, False),
        ({"PYTORCH_ALLOC_CONF": "expandable_segments:True"}, True),
        (
            {
                "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
                "PYTORCH_ALLOC_CONF": "expandable_segments:False",
            },
            False,
        ),
        ({"PYTORCH_CUDA_ALLOC_CONF": "garbage,,:"}, False),
    ],
)
def test_expandable_segments_setting(environ, expected):
    assert expandable_segments(environ) is expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [("0", True), ("false", True), ("OFF", True), ("no", True), ("1", False), ("", False)],
)
def test_ipc_disabled(value, expected):
    assert ipc_disabled({"ZMQSYNC_CUDA_IPC": value}) is expected
    assert ipc_disabled({}) is False


# --- devices by UUID ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        UUID,
        UUID.lower(),
        UUID.upper(),
        UUID[4:],  # what torch's props.uuid prints
        UUID[4:].replace("-", ""),
        f"  {UUID} ",
    ],
)
def test_uuid_forms_normalize_to_one(text):
    assert normalize_uuid(text) == UUID


def test_non_gpu_uuid_strings_are_compared_as_is():
    assert normalize_uuid("MIG-GPU-xyz/1/0") == "MIG-GPU-xyz/1/0"
    assert normalize_uuid("") == ""


def test_local_index_follows_the_uuid_not_the_index():
    # CUDA_VISIBLE_DEVICES=3,1 in the worker: the publisher's GPU is its cuda:1
    visible = [OTHER[4:], UUID[4:].upper()]
    assert local_index(UUID, visible) == 1
    assert local_index(OTHER, visible) == 0
    assert local_index(UUID, []) is None
    assert local_index(UUID, [OTHER]) is None
    assert local_index("", [""]) is None


def test_pid_namespace():
    assert pid_namespace() == os.stat("/proc/self/ns/pid").st_ino > 0
    assert pid_namespace("/nonexistent/ns/pid") == 0
