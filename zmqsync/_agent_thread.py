"""The shape every socket-owning agent thread has: a pipe, a thread, a start and a stop,
each wait with a named deadline.

ZeroMQ sockets are not thread-safe, so each agent (the publisher's, a relay root's, a
relay's) owns its sockets on a thread of its own, and the object that users call talks
to it over an inproc PAIR pipe, never touching those sockets. The parts are the same in
each, and are here once:

* the owner's end of the pipe is bound before the thread starts, and every send on it
  is non-blocking and made under one lock (`post`): a PAIR send blocks for good once
  the agent has gone, and an owner cannot know that it has not;
* the thread connects its end, binds what it serves (`_bind`), says it started (or why
  it failed, which `start` raises on the owner's thread; what it had bound goes with the
  context), runs its loop (`_loop`; a failure is logged and handed to `_failed`), and
  closes its sockets on the way out (`_finish`), also when the loop failed;
* `start` waits AGENT_START_S for the thread to say so; `stop` asks it to stop and joins
  it for `stop_s`, then closes the pipe and destroys the context (its sockets are closed
  by then, or, if the thread is stuck, left to it: a warning says so).
"""

from __future__ import annotations

import logging
import threading

import zmq

from ._config import AGENT_START_S, THREAD_JOIN_S
from ._errors import ZmqSyncError
from ._lifecycle import signals_held
from ._sockets import post

__all__ = ["AgentThread"]

log = logging.getLogger(__name__)


class AgentThread:
    """An agent thread and its pipe (see the module doc).

    Args:
        name: the thread's name (``zmqsync-...``), also the pipe's.
        what: what the agent is, for messages ("publisher agent").
        stop_s: how long `stop` waits for the thread to end.
        pipe_lock: the lock sends on the pipe take (one of the owner's, if it has one).
    """

    def __init__(
        self,
        name: str,
        what: str,
        stop_s: float = THREAD_JOIN_S,
        pipe_lock: threading.Lock | None = None,
    ) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.what, self.stop_s = what, stop_s
        self.pipe_lock = pipe_lock or threading.Lock()
        self._pipe_in = self.ctx.socket(zmq.PAIR)
        self._pipe_in.linger = 0
        self._pipe_addr = f"inproc://{name}-{id(self)}"
        self._pipe_in.bind(self._pipe_addr)
        self._started = threading.Event()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    # --- the owner's side ---

    def start(self) -> None:
        """Run the thread; return once it serves.

        Raises:
            whatever `_bind` raised on the agent thread, or ZmqSyncError when the thread
            did not say it started within AGENT_START_S.
        """
        try:
            self._thread.start()
            started = self._started.wait(AGENT_START_S)
        except BaseException:  # interrupted (SIGTERM's SystemExit, Ctrl-C) while it binds:
            with signals_held():  # a second signal waits for this stop
                self.stop()  # the sockets it bound close now (an ipc file goes with them)
            raise
        if not started or self._failure is not None:
            failure = self._failure
            self.stop()
            raise failure or ZmqSyncError(f"{self.what} did not start within {AGENT_START_S:g} s")

    def post(self, *frames: bytes) -> bool:
        """Send `frames` to the agent thread; False if it was not taken (gone, or full)."""
        with self.pipe_lock:
            return not self._pipe_in.closed and post(self._pipe_in, *frames)

    def stop(self) -> None:
        """Ask the thread to stop, wait `stop_s` for it, release the pipe and context.
        Idempotent."""
        if self._thread.is_alive():
            self.post(b"stop")
            self._thread.join(self.stop_s)
            if self._thread.is_alive():
                log.warning("%s thread did not stop within its deadline", self.what)
        self._release()

    def _release(self) -> None:
        with self.pipe_lock:
            self._pipe_in.close()
        self.ctx.destroy(linger=0)

    @property
    def on_agent_thread(self) -> bool:
        return threading.current_thread() is self._thread

    # --- the agent thread ---

    def _run(self) -> None:
        try:
            self.pipe = self.ctx.socket(zmq.PAIR)  # fails once a start cut short stopped us
            self.pipe.linger = 0
            self.pipe.connect(self._pipe_addr)
            self._bind()
        except BaseException as exc:  # reported to start() on the owner's thread
            self._failure = exc
            if hasattr(self, "pipe"):
                self.pipe.close()  # the rest goes with the context (start() stops it)
            self._started.set()
            return
        self._started.set()
        try:
            self._loop()
        except BaseException as exc:
            log.exception("%s failed", self.what)
            self._failed(exc)
        finally:
            self._finish()

    def _bind(self) -> None:
        """Open what the agent serves (agent thread); raise to fail `start`."""

    def _loop(self) -> None:
        """Serve until the pipe says stop (agent thread)."""
        raise NotImplementedError

    def _failed(self, exc: BaseException) -> None:
        """The loop raised `exc` (agent thread): tell whoever waits on this agent."""

    def _finish(self) -> None:
        """Close this thread's sockets (agent thread), the pipe's end included."""
        self.pipe.close()
