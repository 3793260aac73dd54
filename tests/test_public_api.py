"""The public surface: exact exports, the error tree, reprs, leak warnings, py.typed."""

from __future__ import annotations

import gc
import importlib.resources
import inspect
import re
import types
import weakref

import pytest
import torch

import zmqsync
from tests.conftest import ROOT, deadline_listdir
from zmqsync import _errors

ERRORS = {
    "BufferUnavailable": OSError,
    "ClosedError": RuntimeError,
    "ConnectTimeout": TimeoutError,
    "FdLimitTooLow": OSError,
    "LayoutMismatch": ValueError,
    "ProtocolError": None,
    "PublishTimeout": TimeoutError,
    "RanksFailed": RuntimeError,
    "SharedMemoryFull": OSError,
}


def test_all_exports_are_exactly_the_public_names():
    """httpx's tests/test_exported_members.py: nothing public is left out of __all__.

    The exports load on first use (PEP 562), so every name `dir()` lists is resolved
    first; then the module's namespace must hold exactly `__all__` in public names."""
    for member in dir(zmqsync):
        getattr(zmqsync, member)
    public = [
        member
        for member, value in vars(zmqsync).items()
        if not member.startswith("_") and not isinstance(value, types.ModuleType)
    ]
    assert zmqsync.__all__ == sorted(public, key=str.casefold)


def test_exports_resolve_and_version_is_a_string():
    for member in zmqsync.__all__:
        assert getattr(zmqsync, member) is not None
    assert isinstance(zmqsync.__version__, str)
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", zmqsync.__version__)


def test_exported_errors_are_exactly_the_documented_ones():
    exported = {
        name
        for name in zmqsync.__all__
        if inspect.isclass(obj := getattr(zmqsync, name)) and issubclass(obj, BaseException)
    }
    assert exported == set(ERRORS) | {"ZmqSyncError"}
    assert set(_errors.__all__) == exported


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_every_error_is_a_zmqsync_error_and_its_builtin(name):
    cls = getattr(zmqsync, name)
    assert issubclass(cls, zmqsync.ZmqSyncError)
    builtin = ERRORS[name]
    if builtin is not None:
        assert issubclass(cls, builtin), f"except {builtin.__name__} must catch {name}"
    assert cls.__doc__ and cls.__doc__.strip(), "one-line class docstring"


@pytest.mark.parametrize("name", sorted(ERRORS) + ["ZmqSyncError"])
def test_exported_errors_read_zmqsync_in_tracebacks(name):
    cls = getattr(zmqsync, name)
    assert cls.__module__ == "zmqsync"
    assert f"{cls.__module__}.{cls.__qualname__}" == f"zmqsync.{name}"


def test_protocol_error_is_not_a_builtin_misuse_error():
    """Remote garbage is not local misuse: `except ValueError` must not swallow it."""
    assert not issubclass(zmqsync.ProtocolError, ValueError | TypeError | RuntimeError | OSError)


def test_error_data_lives_on_the_exception():
    exc = zmqsync.PublishTimeout("version 7: ...", version=7, acked=["w1"], missing=["w3", "w5"])
    assert (exc.version, exc.acked, exc.missing) == (7, ("w1",), ("w3", "w5"))
    assert str(exc) == "version 7: ..."
    full = zmqsync.SharedMemoryFull("no room", path="/dev/shm/x", needed=10, free=3)
    assert (full.path, full.needed, full.free) == ("/dev/shm/x", 10, 3)
    assert str(full) == "no room"
    assert str(zmqsync.BufferUnavailable("cannot open")) == "cannot open"
    with pytest.raises(TimeoutError):
        raise zmqsync.ConnectTimeout("no publisher")


def test_error_tree_in_the_errors_docstring_names_every_error():
    doc = _errors.__doc__ or ""
    missing = [name for name in sorted(ERRORS) if not re.search(rf"\b{name}\b", doc)]
    assert not missing, f"not drawn in the error tree: {missing}"


# --- reprs ------------------------------------------------------------------------------


def test_publisher_and_subscriber_reprs_carry_name_version_and_state(name):
    pub = zmqsync.Publisher({"w": torch.zeros(3)}, name=name)
    assert repr(pub).startswith(f"<Publisher {name!r} ")
    assert repr(pub).endswith(" new>")
    with pub:
        assert re.fullmatch(rf"<Publisher {name!r} v0 ipc://\S+ 0 workers started>", repr(pub))
        sub = zmqsync.Subscriber(name=name, worker_id="w0")
        assert repr(sub) == f"<Subscriber {name!r} v-1 copy new>"
        with sub:
            assert repr(sub) == f"<Subscriber {name!r} v0 copy connected>"
            assert " 1 workers started>" in repr(pub)
            pub.publish(weights={"w": torch.ones(3)})
            assert sub.wait_for_version(1, timeout=10)
            assert repr(sub) == f"<Subscriber {name!r} v1 copy connected>"
            assert repr(pub).startswith(f"<Publisher {name!r} v1 ")
        assert repr(sub) == f"<Subscriber {name!r} v1 copy closed>"
        manual = zmqsync.Subscriber(name=name, reads=zmqsync.Aliases(manual=True))
        assert "alias/manual" in repr(manual)
    assert repr(pub).endswith(" closed>")


def test_publish_handle_repr(name):
    with zmqsync.Publisher({"w": torch.zeros(3)}, name=name) as pub:
        p = pub.publish()
        assert re.fullmatch(r"<Publish v1 done \d+\.\d\d ms>", repr(p))


# --- lifecycle: leaks warn and clean up -------------------------------------------------


def test_unclosed_publisher_warns_and_still_removes_its_segment(name, bus_dirs):
    _, shm = bus_dirs
    pub = zmqsync.Publisher({"w": torch.zeros(3)}, name=name).start()
    ref = weakref.ref(pub)
    assert len(list(shm.iterdir())) == 1
    try:
        with pytest.warns(ResourceWarning, match=rf"unclosed <Publisher {name!r} v0 "):
            del pub
            gc.collect()
        assert ref() is None
        assert deadline_listdir(str(shm)) == []
    finally:
        if (leaked := ref()) is not None:
            leaked.close()


def test_unclosed_subscriber_warns(name):
    with zmqsync.Publisher({"w": torch.zeros(3)}, name=name) as pub:
        sub = zmqsync.Subscriber(name=name).start()
        ref = weakref.ref(sub)
        try:
            with pytest.warns(ResourceWarning, match=rf"unclosed <Subscriber {name!r} v0 "):
                del sub
                gc.collect()
            assert ref() is None
        finally:
            if (leaked := ref()) is not None:
                leaked.close()
        assert pub.version == 0


def test_never_started_or_closed_objects_do_not_warn(name):
    pub = zmqsync.Publisher({"w": torch.zeros(3)}, name=name)
    sub = zmqsync.Subscriber(name=name)
    del pub, sub
    gc.collect()  # filterwarnings=error: a ResourceWarning here would fail the test
    with zmqsync.Publisher({"w": torch.zeros(3)}, name=name) as pub:
        pass
    pub.close()  # idempotent
    del pub
    gc.collect()


def test_closed_objects_refuse_to_restart(name):
    pub = zmqsync.Publisher({"w": torch.zeros(3)}, name=name)
    pub.close()
    with pytest.raises(zmqsync.ClosedError, match="closed"):
        pub.start()
    with pytest.raises(zmqsync.ClosedError, match="closed"):
        pub.publish()
    sub = zmqsync.Subscriber(name=name)
    sub.close()
    with pytest.raises(zmqsync.ClosedError, match="closed"):
        sub.start()


# --- packaging --------------------------------------------------------------------------


def test_package_ships_py_typed():
    marker = importlib.resources.files("zmqsync").joinpath("py.typed")
    assert marker.is_file()
    pyproject = (ROOT / "pyproject.toml").read_text()  # no tomllib: Python 3.10 is supported
    section = pyproject.split("[tool.setuptools.package-data]\n", 1)[1].split("\n[", 1)[0]
    assert re.search(r'^zmqsync = \[.*"py\.typed".*\]', section, re.M), section


def test_every_public_class_takes_security_and_refuses_the_options_of_the_other_side():
    # one object for who may reach a bus and whom a worker trusts; each class uses the
    # options that apply to it and says which one does not
    client = zmqsync.CurveClient("s" * 40, "p" * 40, "k" * 40)
    with pytest.raises(ValueError, match="a Subscriber joins a bus: tap, max_workers are"):
        zmqsync.Subscriber(name="x", security=zmqsync.Security(tap=True, max_workers=2))
    with pytest.raises(ValueError, match="insecure is an option of the publisher's"):
        zmqsync.Subscriber(name="x", security=zmqsync.Security(insecure=True))
    with pytest.raises(ValueError, match="not a CurveServer"):
        server = zmqsync.CurveServer("s" * 40, "k" * 40)
        zmqsync.Subscriber(name="x", security=zmqsync.Security(curve=server))
    with pytest.raises(ValueError, match="not a CurveClient"):
        zmqsync.Publisher({"w": torch.zeros(1)}, name="x", security=zmqsync.Security(curve=client))
    with pytest.raises(ValueError, match="publisher_uid= is a subscriber's option"):
        zmqsync.Publisher({"w": torch.zeros(1)}, security=zmqsync.Security(publisher_uid=0))
    with pytest.raises(TypeError, match="security= takes a zmqsync.Security"):
        zmqsync.Subscriber(name="x", security={"curve": client})  # type: ignore[arg-type]
    sub = zmqsync.Subscriber(name="x", security=zmqsync.Security(curve=client, publisher_uid=0))
    sub.close()
    root = zmqsync.RelayRoot(
        name="x",
        tree=zmqsync.Tree("tcp://198.51.100.3:29500"),
        security=zmqsync.Security(insecure=True),
    )  # a root may say its rendezvous network is trusted; no I/O until start()
    assert root.address == ""
    for cls in (zmqsync.Publisher, zmqsync.Subscriber, zmqsync.Relay, zmqsync.RelayRoot):
        params = inspect.signature(cls).parameters
        assert "security" in params
        assert not {"curve", "insecure", "tap", "publisher_uid"} & set(params), cls


def test_the_relay_options_are_exported_beside_the_relays():
    # each side of a relay tree takes its own options object, found where its class is
    import zmqsync.relay

    assert (zmqsync.Tree, zmqsync.Branch) == (zmqsync.relay.Tree, zmqsync.relay.Branch)
    for cls, kind in ((zmqsync.RelayRoot, zmqsync.Tree), (zmqsync.Relay, zmqsync.Branch)):
        assert inspect.signature(cls).parameters["tree"].default == kind()


def test_publish_has_one_knob_for_how_long_it_waits():
    params = inspect.signature(zmqsync.Publisher.publish).parameters
    assert "wait" not in params and params["max_lag"].default == 0


def test_how_a_worker_reads_is_one_object_holding_only_what_applies(name):
    """`reads=` takes Copies or Aliases; options that cannot apply cannot be spelled."""
    with pytest.raises(TypeError):
        zmqsync.Aliases(flat=True)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="reads="):
        zmqsync.Subscriber(name=name, reads="alias")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="manual"):
        zmqsync.Copies(manual="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="on_update"):
        zmqsync.Aliases(on_update=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="without a model"):
        zmqsync.Subscriber(
            name=name, model=torch.nn.Linear(2, 2), reads=zmqsync.Copies(device="cpu")
        )
    for gone in ("mode", "apply", "flat", "device", "on_update"):
        with pytest.raises(TypeError):
            zmqsync.Subscriber(name=name, **{gone: None})
