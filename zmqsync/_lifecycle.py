"""One lifecycle for every public object that opens something: Publisher, Subscriber,
Relay and RelayRoot.

Each is built (NEW), started once (STARTED: sockets bound or connected, buffers mapped,
threads running) and closed once (CLOSED, final: a closed object is never started
again; create a new one). `Lifecycle` holds the state as an enum and the parts that must
not differ between them:

* ``close()`` is idempotent, and in a process forked from the one that started the
  object it releases nothing: the sockets, threads and segments are the parent's.
* ``with obj:`` starts and closes.
* An object collected while started is closed first, then warned about
  (ResourceWarning): with warnings turned into errors, a warning issued first would end
  ``__del__`` before anything was released.
* Whatever is still open at interpreter exit is closed (`atexit`), bounded in time like
  every close: a publisher still broadcasts STOP and unlinks its segment. A SIGKILL
  skips this; the flock-based garbage collection covers that case.
* SIGTERM (``docker stop``, ``kill``, a supervisor) would end the process without any
  of that: its default action does not unwind Python. The first object starting on the
  main thread of a process whose SIGTERM handler is still the default installs one (as
  its start begins: a SIGTERM mid-start unwinds what that start had opened) that
  raises ``SystemExit(143)`` there, as SIGINT raises KeyboardInterrupt: ``with`` blocks
  and `atexit` close the bus (STOP to the workers at once, socket files and segments
  removed), and the exit status still says SIGTERM. A process with its own handler (set
  before) keeps it, and a child forked from it still dies of SIGTERM as before.
* A signal's exception lands between any two steps of the main thread, and a file made
  by one step and handed to the `ExitStack` that removes it by the next would outlive
  the process if it landed between them (socket files, segments). So each such pair of
  steps, and each close's release, runs under `signals_held`: SIGTERM and Ctrl-C that
  arrive then are raised once it ends. A held step never waits on a peer (every wait
  stays interruptible at once); what it does is bounded (a segment reserved, a thread
  joined for at most its stop deadline).
* Python drops an exception raised inside a finalizer (a ``__del__``, a weakref
  callback) and goes on, and a signal's exception lands wherever the main thread is:
  the `sys.unraisablehook` installed with SIGTERM's handler sends a SIGTERM dropped
  there again a moment later. One SIGTERM ends the process.
"""

from __future__ import annotations

import atexit
import contextlib
import enum
import functools
import os
import signal
import sys
import threading
import warnings
import weakref
from collections.abc import Iterator
from types import FrameType
from typing import Any, Protocol

from ._errors import ClosedError

__all__ = ["Lifecycle", "State", "exit_on_sigterm", "signals_held", "track"]


class State(enum.Enum):
    # NEW: built; nothing is open yet.
    NEW = "new"
    # STARTED: open (sockets, buffers, threads) in the process that started it.
    STARTED = "started"
    # CLOSED: final; everything it opened is released.
    CLOSED = "closed"


class _Closable(Protocol):
    def close(self) -> None: ...


_live: weakref.WeakSet[_Closable] = weakref.WeakSet()


def track(obj: _Closable) -> None:
    """Close `obj` at interpreter exit if it is still open then."""
    _live.add(obj)


@atexit.register
def _close_all() -> None:
    for obj in list(_live):
        with contextlib.suppress(Exception):
            obj.close()


_installed_in = 0  # the process that installed `_terminated`
_holding = 0  # how many `signals_held` the main thread is in
_held: list[int] = []  # the signals that arrived during them, first first
_RESEND_S = 0.01  # a dropped signal is sent again once the finalizer it hit is done


def _raise_for(signum: int) -> None:
    exc: BaseException = (
        KeyboardInterrupt() if signum == signal.SIGINT else SystemExit(128 + signum)
    )
    exc.zmqsync_signal = signum  # type: ignore[attr-defined]  # for `_dropped`
    raise exc


def _terminated(signum: int, frame: FrameType | None) -> None:
    if os.getpid() != _installed_in:  # a forked child: it ends as it would have
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    if _holding:
        _held.append(signum)
        return
    _raise_for(signum)


def _interrupted(signum: int, frame: FrameType | None) -> None:
    """SIGINT's handler during `signals_held` (Python's own raises KeyboardInterrupt)."""
    if _holding:
        _held.append(signum)
        return
    _raise_for(signum)


def _dropped(before: Any, unraisable: Any) -> None:
    """`sys.unraisablehook` once `_terminated` handles SIGTERM. Python drops an exception
    raised inside a finalizer (a ``__del__``, a weakref callback: a signal's lands
    wherever the main thread is, pyzmq's ``Socket.__del__`` included) and goes on, so a
    SIGTERM would be lost; it is sent again, from another thread a moment later, to land
    in the main thread's own code. Everything else goes to the hook there was before."""
    signum = getattr(unraisable.exc_value, "zmqsync_signal", None)
    if signum is not None:
        timer = threading.Timer(_RESEND_S, os.kill, (os.getpid(), signum))
        timer.daemon = True
        timer.start()
        return
    before(unraisable)


def exit_on_sigterm() -> None:
    """Make SIGTERM unwind this process (see the module doc), if nobody chose otherwise:
    only on the main thread, and only while SIGTERM's handler is the default."""
    if threading.current_thread() is not threading.main_thread():
        return
    with contextlib.suppress(ValueError, OSError):  # no signals here (an embedded Python)
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            global _installed_in
            _installed_in = os.getpid()
            signal.signal(signal.SIGTERM, _terminated)
            sys.unraisablehook = functools.partial(_dropped, sys.unraisablehook)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """SIGTERM (once `exit_on_sigterm` made it raise) and Ctrl-C that arrive inside are
    raised as it ends (the module doc says why). Nests; only the main thread, where
    Python runs signal handlers, holds anything; a SIGINT handler of the user's is left
    alone."""
    global _holding
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _holding += 1  # no signal handler runs between this step and the `try`
    swapped = False
    try:
        if _holding == 1:
            with contextlib.suppress(ValueError, OSError):  # no signals here
                if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                    signal.signal(signal.SIGINT, _interrupted)
                    swapped = True
        yield
    finally:
        _holding -= 1
        if swapped:  # from here a SIGINT raises at once again, through either handler
            signal.signal(signal.SIGINT, signal.default_int_handler)
        if _holding == 0 and _held:
            signum = _held[0]
            _held.clear()
            _raise_for(signum)


class Lifecycle:
    """The state and the lifecycle methods shared by the public classes (module doc).

    A subclass calls `_starting` first in ``start()`` and `_started` once it is open;
    ``close()`` calls `_closing` first and releases what it opened only when that says
    so. `_title` names the object in errors ("Relay 'host-1'").
    """

    _state: State = State.NEW  # a class default: __del__ of a half-built object reads it
    _pid: int = 0

    def start(self) -> Any:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def _title(self) -> str:
        return type(self).__name__

    def _starting(self) -> bool:
        """Whether start() has work to do: False when started already (it returns self).

        Raises:
            ClosedError: closed already: a closed object is never started again.
        """
        if self._state is State.CLOSED:
            raise ClosedError(f"{self._title()} is closed; create a new one")
        if self._state is State.STARTED:
            return False
        self._pid = os.getpid()
        exit_on_sigterm()  # before anything is opened: a SIGTERM mid-start unwinds it too
        return True

    def _started(self) -> None:
        """start() opened everything: STARTED, and closed at exit if still open then."""
        self._state = State.STARTED
        track(self)

    def _closing(self) -> bool:
        """CLOSED from now on; whether close() must release anything: only once, and only
        in the process that started it."""
        mine = self._state is State.STARTED and os.getpid() == self._pid
        self._state = State.CLOSED  # last: a signal's exception cannot land between
        return mine

    @property
    def closed(self) -> bool:
        """Whether close() was called (final)."""
        return self._state is State.CLOSED

    def __enter__(self) -> Any:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self, _started: State = State.STARTED, _warn: Any = warnings.warn) -> None:
        # bound at definition: at interpreter exit this module's globals may be gone
        # (None) before the last objects are collected
        if self._state is not _started:
            return
        unclosed = f"unclosed {self!r}"
        try:
            self.close()
        except Exception:  # a finalizer has no caller to raise to
            pass
        _warn(
            f"{unclosed}: closed by the garbage collector (use `with` or call close())",
            ResourceWarning,
            stacklevel=1,
        )
