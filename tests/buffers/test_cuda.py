"""The CUDA transport.

Without a GPU (CI) this tests what does not need one: the handle's wire fields and their
checks, opening a handle (refused, mapped to the fallback), the export's refusals, and,
through a fake CUDA buffer held in CPU memory, everything the publisher and subscribers
do around it: the CPU copy kept only while a worker reads it, the second HELLO of a
worker that cannot map the GPU buffer, the reason in `inspect`, a CUDA worker of a CPU
publisher, and a real worker process reading the CPU copy of "CUDA" weights.

Tests marked ``cuda`` run the real thing and are skipped without a GPU;
``tools/gpu_check.py`` is the full check on GPU hardware.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time

import msgpack
import pytest
import torch

import zmqsync
from tests.conftest import ROOT
from zmqsync import _publisher, _read_modes, _source
from zmqsync._buffers import CudaAttachment, SharedBuffer
from zmqsync._buffers import cuda as zcuda
from zmqsync._buffers.transport import CPU_PUBLISHER, DISABLED, NO_GPU, pid_namespace
from zmqsync._checksum import CHECKSUM_KEY, digest, digest_tensor
from zmqsync._errors import ProtocolError
from zmqsync._protocol import BufferInfo, Welcome, decode, encode

HAS_GPU = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(
    not HAS_GPU,
    reason=f"needs a CUDA GPU: torch.cuda.is_available() is False (torch {torch.__version__})",
)
FAKE_UUID = "GPU-5f0c2a1e-8d7b-4c3a-9e21-0123456789ab"
HANDLE = bytes(range(64))


# --- wire fields ----------------------------------------------------------------------------


def cuda_info(**changes) -> BufferInfo:
    fields = {
        "kind": "cuda",
        "device": "cuda:0",
        "segment": "",
        "size": 2 * 4096,
        "header_bytes": 0,
        "handle": HANDLE,
        "device_uuid": FAKE_UUID,
        "pid_ns": 4026531836,
        "ipc_note": "",
    }
    return BufferInfo(**{**fields, **changes})


def welcome_with(gpu: BufferInfo) -> Welcome:
    cpu = BufferInfo("cpu", "cpu", "zmqsync-p-0123456789abcdef-cpu", 4096 + 2 * 4096, 4096)
    return Welcome(
        bus="0123456789abcdef",
        session="",
        seq=0,
        version=0,
        slot=0,
        slots=2,
        slot_bytes=4096,
        heartbeat=0.5,
        events="ipc:///tmp/x.events",
        acks="ipc:///tmp/x.acks",
        tap="",
        buffers=(cpu, gpu),
        manifest=(),
    )


def test_cuda_buffer_info_round_trips_as_plain_fields():
    welcome = welcome_with(cuda_info())
    data = encode(welcome)
    assert decode(data) == welcome
    raw = msgpack.unpackb(data)["buffers"][1]
    assert raw == {
        "kind": "cuda",
        "device": "cuda:0",
        "segment": "",
        "size": 8192,
        "header_bytes": 0,
        "handle": HANDLE,  # msgpack bin
        "device_uuid": FAKE_UUID,
        "pid_ns": 4026531836,
        "ipc_note": "",
    }


def test_a_cuda_buffer_without_handle_carries_the_reason():
    welcome = welcome_with(cuda_info(handle=b"", ipc_note="expandable segments"))
    assert decode(encode(welcome)).buffers[1].ipc_note == "expandable segments"


@pytest.mark.parametrize(
    "changes",
    [
        {"handle": HANDLE[:63]},
        {"handle": HANDLE + b"\0"},
        {"handle": b"\x03c" + HANDLE},  # torch's versioned form never travels
        {"pid_ns": -1},
        {"pid_ns": 2**63},
        {"pid_ns": 1.0},
        {"ipc_note": "n" * 257},
        {"ipc_note": b"bytes"},
        {"device_uuid": "u" * 65},
        {"size": 4096},  # two slots do not fit
    ],
    ids=repr,
)
def test_wrong_cuda_buffer_fields_are_refused(changes):
    raw = msgpack.unpackb(encode(welcome_with(cuda_info())))
    raw["buffers"][1].update(changes)
    with pytest.raises(ProtocolError):
        decode(msgpack.packb(raw, use_bin_type=True))


def test_missing_new_fields_are_refused():
    raw = msgpack.unpackb(encode(welcome_with(cuda_info())))
    del raw["buffers"][1]["pid_ns"]
    with pytest.raises(ProtocolError, match="missing field 'pid_ns'"):
        decode(msgpack.packb(raw, use_bin_type=True))


# --- export and open, without a GPU ---------------------------------------------------------


def test_attach_refuses_a_buffer_without_a_handle():
    with pytest.raises(ProtocolError, match="64-byte handle"):
        CudaAttachment.attach(cuda_info(handle=b""), slots=2, slot_bytes=4096, device_index=0)


@pytest.mark.skipif(HAS_GPU, reason="checks the refusal on a machine without CUDA")
def test_opening_a_handle_without_cuda_is_an_ipc_failure_not_a_crash():
    before = zcuda.opens()
    with pytest.raises(zcuda.IpcOpenFailed) as caught:
        CudaAttachment.attach(cuda_info(), slots=2, slot_bytes=4096, device_index=0)
    assert str(caught.value) and "\n" not in str(caught.value)
    assert zcuda.opens() == before


def test_export_refusals_say_why():
    handle, why = zcuda._export(torch.zeros(16, dtype=torch.uint8), dedicated=False)
    assert handle == b"" and "MemPool" in why
    if not HAS_GPU:  # a CPU tensor cannot be shared over CUDA IPC
        handle, why = zcuda._export(torch.zeros(16, dtype=torch.uint8), dedicated=True)
        assert handle == b"" and "could not export" in why


def test_cuda_buffer_refuses_a_non_cuda_device():
    with pytest.raises(ValueError, match="cuda:0"):
        zcuda.CudaBuffer("cpu", slots=1, slot_bytes=4096)


def test_visible_uuids_without_cuda(monkeypatch):
    monkeypatch.setattr(zcuda, "cuda_available", lambda: False)
    assert zcuda.visible_uuids() == []


# --- a fake CUDA buffer: the publisher/subscriber logic around it ----------------------------


class FakeCudaBuffer(SharedBuffer):
    """A "CUDA" buffer in CPU memory, described like a real one.

    Registered as a local export (like a real one), so a subscriber in this process maps
    it without the driver: the "cuda" transport runs for real on a CPU. With
    ``register=False`` the handle is unknown here, and opening it goes to the driver.
    """

    kind = "cuda"

    def __init__(self, device, *, slots, slot_bytes, register=True, note="", pid_ns=None):
        self.size = slots * slot_bytes
        self._slot_bytes = slot_bytes
        self._flat = torch.zeros(self.size, dtype=torch.uint8)
        self._handle = b"" if note else os.urandom(64)
        if register and self._handle:
            zcuda._LOCAL_EXPORTS[self._handle] = self._flat
        ns = pid_namespace() if pid_ns is None else pid_ns
        self._info = BufferInfo("cuda", device, "", self.size, 0, self._handle, FAKE_UUID, ns, note)

    def slot(self, index):
        return self._flat[index * self._slot_bytes : (index + 1) * self._slot_bytes]

    def describe(self):
        return self._info

    def close(self):
        zcuda._LOCAL_EXPORTS.pop(self._handle, None)


@pytest.fixture
def fake_gpu(monkeypatch):
    """fake_gpu(**buffer options): weights published from now on go to a fake "cuda:0"."""

    def install(**options):
        monkeypatch.setattr(_source, "_tensor_device", lambda t: "cuda:0")
        monkeypatch.setattr(
            _publisher, "_DEVICE_BUFFER", functools.partial(FakeCudaBuffer, **options)
        )

    return install


@pytest.fixture
def worker_sees_gpu(monkeypatch):
    """Subscribers in this process see the fake GPU (CUDA available, its UUID visible)."""
    monkeypatch.setattr(zcuda, "cuda_available", lambda: True)
    monkeypatch.setattr(zcuda, "visible_uuids", lambda: [FAKE_UUID[4:]])


def weights(v: float) -> dict[str, torch.Tensor]:
    return {
        "w": torch.full((64, 64), v),
        "b": torch.full((7,), v, dtype=torch.bfloat16),
        "n": torch.tensor(int(v)),
    }


def state_of(pub):
    from zmqsync._cli.buses import inspect_bus

    return {w.worker_id: w for w in inspect_bus(pub.address, 5.0).workers}


def assert_holds(tensors, v):
    for key, t in tensors.items():
        assert torch.equal(t.float(), torch.full(t.shape, float(v))), (key, v)


def test_cuda_bus_describes_both_buffers_and_lays_tensors_in_the_gpu_one(fake_gpu, name):
    fake_gpu()
    with zmqsync.Publisher(weights(0), name=name) as pub:
        cpu, gpu = pub._mode.bound.slots.describe()
        assert (cpu.kind, gpu.kind) == ("cpu", "cuda")
        assert {s.buffer for s in pub._layout.specs} == {1}
        assert gpu.size == 2 * pub._layout.slot_bytes and gpu.header_bytes == 0
        assert pub._mode.bound.slots.mirrored == [
            False,
            False,
        ]  # no worker reads the CPU copy: none made


def test_cpu_worker_reads_the_cpu_copy_made_only_while_it_is_there(fake_gpu, name):
    fake_gpu()
    with zmqsync.Publisher(weights(0), name=name) as pub:
        pub.publish(weights=weights(1))  # nobody reads the CPU copy: not written
        slot = pub._role.registry.slot_of(1)
        assert not pub._mode.bound.slots.mirrored[slot]
        assert not pub._mode.bound.slots.views(slot)[("w",)].any()
        model = {k: torch.zeros_like(t) for k, t in weights(0).items()}
        with zmqsync.Subscriber(name=name, model=model) as sub:
            assert sub.transport == "cpu" and sub.transport_note == ""
            assert_holds(model, 1)  # the current version was copied before its WELCOME
            for v in (2, 3):
                pub.publish(weights=weights(v))
                assert sub.version == v
                assert_holds(model, v)
            assert pub.workers[sub.worker_id].transport == "cpu"
            assert all(pub._mode.bound.slots.mirrored)
        deadline = time.monotonic() + 10
        while pub.workers and time.monotonic() < deadline:  # its BYE is handled
            time.sleep(0.01)
        pub.publish(weights=weights(4))  # it left: the CPU copy is no longer kept
        assert not pub._mode.bound.slots.mirrored[pub._role.registry.slot_of(4)]
        assert pub.counters["handshakes"] == 1


@pytest.mark.parametrize("mode", ["alias", "copy"])
def test_gpu_worker_maps_the_cuda_buffer_and_no_cpu_copy_is_made(
    fake_gpu, worker_sees_gpu, name, mode
):
    fake_gpu()
    with (
        zmqsync.Publisher(weights(0), name=name) as pub,
        zmqsync.Subscriber(
            name=name, reads=(zmqsync.Aliases() if mode == "alias" else zmqsync.Copies())
        ) as sub,
    ):
        assert (sub.transport, sub.transport_note) == ("cuda", "")
        assert pub.workers[sub.worker_id].transport == "cuda"
        for v in (1, 2, 3):
            pub.publish(weights=weights(v))
            assert_holds(sub._reader.target.tensors, v)
        gpu_memory = pub._mode.bound.slots._cuda[0]._flat
        start, end = gpu_memory.data_ptr(), gpu_memory.data_ptr() + gpu_memory.numel()
        inside = start <= sub._reader.target.tensors[("w",)].data_ptr() < end
        assert inside == (mode == "alias")
        assert not any(pub._mode.bound.slots.mirrored)
        assert state_of(pub)[sub.worker_id].transport_note == ""


def test_handle_refused_by_the_driver_falls_back_with_a_second_hello(
    fake_gpu, worker_sees_gpu, monkeypatch, name, caplog
):
    fake_gpu(register=False)  # unknown here: opening goes to the driver
    opened = []
    real = zcuda._open

    def refuse(info, index):
        opened.append(index)
        if HAS_GPU:  # a random handle: the real driver refuses it too
            return real(info, index)
        raise zcuda.IpcOpenFailed("RuntimeError: CUDA error: operation not permitted")

    monkeypatch.setattr(zcuda, "_open", refuse)
    with (
        zmqsync.Publisher(weights(0), name=name) as pub,
        zmqsync.Subscriber(name=name) as sub,
    ):
        assert sub.transport == "cpu"
        assert "opening the CUDA IPC handle failed" in sub.transport_note
        assert opened == [0]
        assert pub.counters["handshakes"] == 2  # the second HELLO registered "cpu"
        assert pub.workers[sub.worker_id].transport == "cpu"
        assert state_of(pub)[sub.worker_id].transport_note == sub.transport_note
        assert_holds(sub._reader.target.tensors, 0)
        pub.publish(weights=weights(5))
        assert_holds(sub._reader.target.tensors, 5)
        assert opened == [0]  # never opened again after the handshake
    assert any("reads the CPU buffer" in r.getMessage() for r in caplog.records)


def test_rejoining_the_same_bus_reuses_the_mapping(fake_gpu, worker_sees_gpu, monkeypatch, name):
    fake_gpu()
    attached = []
    real = CudaAttachment.attach.__func__

    def counting(cls, *args, **kwargs):
        attached.append(args[0].handle)
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(CudaAttachment, "attach", classmethod(counting))
    with (
        zmqsync.Publisher(weights(0), name=name, on_timeout="evict", heartbeat=0.1) as pub,
        zmqsync.Subscriber(name=name, reads=zmqsync.Copies(manual=True)) as sub,
    ):
        first = sub._reader.gpus[0]
        p = pub.publish(weights=weights(1), timeout=0.5)  # it does not poll: evicted
        assert p.missing == (sub.worker_id,)
        deadline = time.monotonic() + 20
        while sub.worker_id not in pub.workers and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sub.worker_id in pub.workers, "the evicted worker did not re-join"
        assert sub.poll(5.0) and sub.version == 1
        assert_holds(sub._reader.target.tensors, 1)
        assert sub._reader.gpus == [first] and len(attached) == 1  # mapped once, kept


@pytest.mark.parametrize(
    ("options", "visible", "needle"),
    [
        ({"pid_ns": 12345}, [FAKE_UUID], "another PID namespace"),
        ({"note": "expandable segments"}, [FAKE_UUID], "no CUDA IPC handle: expandable"),
        ({}, ["GPU-00000000-0000-0000-0000-000000000000"], "is not visible"),
    ],
    ids=["pid-namespace", "no-handle", "uuid-not-visible"],
)
def test_bus_facts_that_rule_out_cuda_ipc(
    fake_gpu, worker_sees_gpu, monkeypatch, name, options, visible, needle
):
    fake_gpu(**options)
    monkeypatch.setattr(zcuda, "visible_uuids", lambda: visible)
    with (
        zmqsync.Publisher(weights(0), name=name) as pub,
        zmqsync.Subscriber(name=name) as sub,
    ):
        assert sub.transport == "cpu" and needle in sub.transport_note
        assert needle in state_of(pub)[sub.worker_id].transport_note
        pub.publish(weights=weights(2))
        assert_holds(sub._reader.target.tensors, 2)


def test_ipc_disabled_by_environment_needs_one_hello(fake_gpu, worker_sees_gpu, monkeypatch, name):
    fake_gpu()
    monkeypatch.setenv("ZMQSYNC_CUDA_IPC", "0")
    with (
        zmqsync.Publisher(weights(0), name=name) as pub,
        zmqsync.Subscriber(name=name, reads=zmqsync.Aliases()) as sub,
    ):
        assert (sub.transport, sub.transport_note) == ("cpu", DISABLED)
        assert pub.counters["handshakes"] == 1
        assert state_of(pub)[sub.worker_id].transport_note == DISABLED


def test_worker_without_gpu_says_so_on_a_cuda_bus(fake_gpu, monkeypatch, name):
    fake_gpu()
    monkeypatch.setattr(zcuda, "cuda_available", lambda: False)
    with (
        zmqsync.Publisher(weights(0), name=name) as pub,
        zmqsync.Subscriber(name=name) as sub,
    ):
        assert (sub.transport, sub.transport_note) == ("cpu", NO_GPU)
        assert pub.counters["handshakes"] == 1


def test_cuda_worker_of_a_cpu_publisher_is_told_it_copies_itself(worker_sees_gpu, name):
    with (
        zmqsync.Publisher(weights(0), name=name) as pub,
        zmqsync.Subscriber(name=name) as sub,
    ):
        assert (sub.transport, sub.transport_note) == ("cpu", CPU_PUBLISHER)
        assert pub.counters["handshakes"] == 1
        info = pub.workers[sub.worker_id]
        assert info.transport == "cpu"
        assert state_of(pub)[sub.worker_id].transport_note == CPU_PUBLISHER
        pub.publish(weights=weights(3))
        assert_holds(sub._reader.target.tensors, 3)


def test_inspect_json_shows_transport_and_reason(fake_gpu, monkeypatch, name, capsys):
    from zmqsync.cli import main

    fake_gpu()
    monkeypatch.setenv("ZMQSYNC_CUDA_IPC", "off")
    monkeypatch.setattr(zcuda, "cuda_available", lambda: True)
    with zmqsync.Publisher(weights(0), name=name), zmqsync.Subscriber(name=name, worker_id="w"):
        assert main(["inspect", "--name", name, "--json"]) == 0
    state = json.loads(capsys.readouterr().out)
    assert [(w["transport"], w["transport_note"]) for w in state["workers"]] == [("cpu", DISABLED)]
    assert [b["kind"] for b in state["buffers"]] == ["cpu", "cuda"]
    assert all("handle" not in b for b in state["buffers"])


def test_worker_process_verifies_the_cpu_copy_of_cuda_weights(fake_gpu, spawn, name):
    """A real process (CPU, no fakes) reads the CPU copy bit-exactly, version by version."""
    fake_gpu()

    def versioned(v):
        flat = {("w",): torch.randn(128, 128), ("h",): torch.randn(9).to(torch.bfloat16)}
        flat[CHECKSUM_KEY] = digest_tensor(digest(flat))
        return {".".join(k): t for k, t in flat.items()}

    with zmqsync.Publisher(versioned(0), name=name, timeout=60) as pub:
        worker = spawn("worker", "--name", name, "--verify", "--json", "--worker-id", "cpu-w")
        assert pub.wait_for_workers(1, timeout=60)
        for v in range(1, 6):
            assert pub.publish(weights=versioned(v)).acked == ("cpu-w",)
        assert pub.workers["cpu-w"].transport == "cpu"
    assert worker.finish() == 0
    summary = worker.summary()
    assert summary["mismatches"] == [] and summary["verified"] >= 5, summary


# --- on a GPU -------------------------------------------------------------------------------


@needs_gpu
@pytest.mark.cuda
def test_real_cuda_buffer_is_exported_once_and_described(name):
    buffer = zcuda.CudaBuffer("cuda:0", slots=2, slot_bytes=1 << 20)
    try:
        info = buffer.describe()
        assert info.kind == "cuda" and info.device == "cuda:0" and info.segment == ""
        assert info.size == 2 << 20 and info.header_bytes == 0
        assert info.device_uuid == zcuda.device_uuid(0) and info.pid_ns == pid_namespace()
        if info.handle:
            assert len(info.handle) == 64 and info.ipc_note == ""
        else:
            pytest.fail(f"buffer not shared: {info.ipc_note}")
        attached = CudaAttachment.attach(info, slots=2, slot_bytes=1 << 20, device_index=0)
        assert attached.slot(1).data_ptr() == buffer.slot(1).data_ptr()  # same process
    finally:
        buffer.close()


def _gpu_worker(spawn, name, worker_id, mode, device, env=None):
    args = ["tools/gpu_check.py", "worker", "--name", name, "--worker-id", worker_id]
    args += ["--mode", mode, "--device", device, "--verify"]
    if env:
        os.environ.update(env)
    try:
        return spawn(*args, module="")
    finally:
        for key in env or {}:
            os.environ.pop(key, None)


@needs_gpu
@pytest.mark.cuda
@pytest.mark.parametrize(
    ("mode", "device", "env", "transport"),
    [
        ("alias", "none", None, "cuda"),
        ("copy", "cuda", None, "cuda"),
        ("copy", "cpu", None, "cpu"),
        ("copy", "cuda", {"ZMQSYNC_CUDA_IPC": "0"}, "cpu"),
    ],
    ids=["alias-cuda", "copy-cuda", "cpu-worker", "fallback"],
)
def test_cuda_publisher_and_worker_process(spawn, name, mode, device, env, transport):
    sys.path.insert(0, str(ROOT / "tools"))
    from gpu_check import bf16_model, versioned

    model = bf16_model("cuda:0", 256)
    with zmqsync.Publisher(versioned(model, 0), name=name, timeout=60) as pub:
        worker = _gpu_worker(spawn, name, "g", mode, device, env)
        worker.wait_for(lambda r: r["event"] == "ready", timeout=120)
        for v in range(1, 6):
            assert pub.publish(weights=versioned(model, v)).acked == ("g",)
        assert pub.workers["g"].transport == transport
    assert worker.finish() == 0
    s = worker.summary()
    assert s["transport"] == transport and s["mismatches"] == [] and s["verified"] == 6, s
    assert s["opens_at_handshake"] == (1 if transport == "cuda" else 0)
    assert s["opens_after_handshake"] == 0


@needs_gpu
@pytest.mark.cuda
def test_cuda_worker_of_a_cpu_publisher_process(spawn, name):
    sys.path.insert(0, str(ROOT / "tools"))
    from gpu_check import bf16_model, versioned

    model = bf16_model("cpu", 256)
    with zmqsync.Publisher(versioned(model, 0), name=name, timeout=60) as pub:
        worker = _gpu_worker(spawn, name, "g", "copy", "cuda")
        worker.wait_for(lambda r: r["event"] == "ready", timeout=120)
        for v in range(1, 4):
            pub.publish(weights=versioned(model, v))
    assert worker.finish() == 0
    s = worker.summary()
    assert s["transport"] == "cpu" and s["note"] == CPU_PUBLISHER and s["verified"] == 4, s
    assert all(d.startswith("cuda") for d in s["devices"])


def test_subscriber_module_uses_the_seams():
    """The fakes above patch what the subscriber really calls."""
    assert _read_modes._cuda is zcuda
    assert sys.modules["zmqsync._buffers.cuda"] is zcuda
