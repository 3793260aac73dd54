"""One lifecycle for Publisher, Subscriber, Relay and RelayRoot (`zmqsync._lifecycle`).

The rules are tested once on a small subclass, then each public class is checked to
take them as they are (no lifecycle method of its own that could drift).
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import warnings

import pytest

import zmqsync
from zmqsync._lifecycle import Lifecycle, State


class Door(Lifecycle):
    """Opens one thing; counts what it released."""

    def __init__(self) -> None:
        self.released = 0

    def start(self) -> Door:
        if self._starting():
            self._started()
        return self

    def close(self) -> None:
        if self._closing():
            self.released += 1

    def __repr__(self) -> str:
        return f"<Door {self._state.value}>"


def test_new_started_closed_and_never_again():
    door = Door()
    assert door._state is State.NEW and not door.closed
    assert door.start() is door and door.start() is door  # a second start is a no-op
    assert door._state is State.STARTED
    door.close()
    door.close()
    assert door.released == 1 and door.closed
    with pytest.raises(zmqsync.ClosedError, match="Door is closed; create a new one"):
        door.start()


def test_closing_what_never_started_releases_nothing_and_is_final():
    door = Door()
    door.close()
    assert door.released == 0 and door.closed
    with pytest.raises(zmqsync.ClosedError):
        door.start()


def test_a_forked_child_releases_nothing_of_its_parents():
    door = Door().start()
    door._pid = os.getpid() + 1  # as a child forked after start() sees it
    door.close()
    assert door.released == 0 and door.closed


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_collected_open_object_is_closed_first_then_warned_about():
    released: list[int] = []

    class Watched(Door):
        def close(self) -> None:
            super().close()
            released.append(self.released)

    Watched().start()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning first would end __del__ early:
        gc.collect()  # the error is raised (and ignored) in __del__, after the close
    assert released == [1]
    with pytest.warns(ResourceWarning, match=r"unclosed <Door started>: closed by the garbage"):
        Watched().start()
        gc.collect()


def test_with_starts_and_closes():
    with Door() as door:
        assert door._state is State.STARTED
    assert door.released == 1


@pytest.mark.parametrize(
    "cls", [zmqsync.Publisher, zmqsync.Subscriber, zmqsync.Relay, zmqsync.RelayRoot]
)
def test_every_public_class_that_opens_something_takes_the_one_lifecycle(cls):
    assert issubclass(cls, Lifecycle)
    own = {name for name in ("__del__", "__exit__", "_starting", "_closing") if name in vars(cls)}
    assert not own, f"{cls.__name__} defines {own} itself"


def test_every_socket_agent_with_a_pipe_takes_the_one_thread_shape():
    from zmqsync._agent_thread import AgentThread
    from zmqsync._publisher_agent import Agent
    from zmqsync.relay._host_agent import RelayAgent
    from zmqsync.relay._root_agent import RootAgent

    for agent in (Agent, RootAgent, RelayAgent):
        assert issubclass(agent, AgentThread)
        assert "_run" not in vars(agent), f"{agent.__name__} runs a thread of its own shape"


def test_no_agent_waits_on_an_inline_number():
    # the waits have names (AGENT_START_S, FIRST_APPLY_S, THREAD_JOIN_S, ...) in _config
    import re
    from pathlib import Path

    root = Path(zmqsync.__file__).parent
    inline = re.compile(r"\.(wait|join)\(\s*\d+(\.\d+)?\s*\)|\+\s*\d+\.\d+\)")
    for path in ("_agent_thread.py", "_publisher_agent.py", "_subscriber_agent.py"):
        text = (root / path).read_text()
        assert not inline.search(text), f"{path}: {inline.search(text)}"
    for path in ("relay/_root_agent.py", "relay/_host_agent.py"):
        text = (root / path).read_text()
        assert not inline.search(text), f"{path}: {inline.search(text)}"


def test_objects_left_to_interpreter_exit_are_finalized_without_noise(name, tmp_path):
    """A started publisher and worker still referenced when the interpreter exits (a
    vLLM worker process ends so): closed at exit, and their finalizers, which may run
    after the module's globals are gone, print nothing."""
    script = tmp_path / "left.py"
    script.write_text(
        "import sys, torch, zmqsync\n"
        "pub = zmqsync.Publisher({'w': torch.zeros(4)}, name=sys.argv[1]).start()\n"
        "sub = zmqsync.Subscriber(name=sys.argv[1]).start()\n"
        "cycle = [pub, sub]\n"
        "cycle.append(cycle)\n"
        "print('started', flush=True)\n"
    )
    done = subprocess.run(
        [sys.executable, str(script), name], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "started" in done.stdout
    assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr, done.stderr


HOLDS = """
import contextlib, os, signal
from zmqsync._lifecycle import exit_on_sigterm, signals_held

def user_handler(signum, frame):
    print("user's handler", flush=True)

exit_on_sigterm()
for sig, nested in {cases}:
    if sig == "user-sigint":
        signal.signal(signal.SIGINT, user_handler)
    try:
        with signals_held():
            with signals_held() if nested else contextlib.nullcontext():
                os.kill(os.getpid(), signal.SIGINT if "sigint" in sig else signal.SIGTERM)
                for _ in range(1000):  # handlers run between steps: many steps go by
                    pass
                print("inner end", flush=True)
            print("outer end", flush=True)
    except BaseException as exc:
        print("raised", type(exc).__name__, getattr(exc, "code", ""), flush=True)
    python_s = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    print("sigint handler is python's:", python_s, flush=True)
    try:  # after a hold: raised at once again (or the user's handler runs)
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):
            pass
    except KeyboardInterrupt:
        print("then at once: KeyboardInterrupt", flush=True)
"""


@pytest.mark.parametrize(
    ("cases", "out"),
    [
        (
            [("sigterm", False), ("sigterm", True)],
            ["inner end", "outer end", "raised SystemExit 143"] * 2,
        ),
        (
            [("sigint", False), ("sigint", True)],
            ["inner end", "outer end", "raised KeyboardInterrupt "] * 2,
        ),
        ([("user-sigint", False)], ["user's handler", "inner end", "outer end"]),
    ],
    ids=["sigterm", "sigint", "user-sigint"],
)
def test_signals_that_arrive_in_a_hold_are_raised_as_it_ends(cases, out):
    # A hold is what keeps a file made by one step and handed to its remover by the next
    # from outliving a signal that lands between them: the body runs to its end, the
    # outermost hold raises, and afterwards a signal raises at once again. A SIGINT
    # handler of the user's is theirs: it runs when the signal comes.
    done = subprocess.run(
        [sys.executable, "-c", HOLDS.format(cases=cases)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if not line.startswith("sigint")]
    user = cases[0][0] == "user-sigint"
    after = ["user's handler"] if user else ["then at once: KeyboardInterrupt"]
    per_case = len(out) // len(cases)
    want = []
    for i in range(len(cases)):
        want += out[i * per_case : (i + 1) * per_case] + after
    assert lines == want, done.stderr
    handler_lines = [line for line in done.stdout.splitlines() if line.startswith("sigint")]
    assert handler_lines == [f"sigint handler is python's: {not user}"] * len(cases)


DROPPED = """
import os, signal, sys, time
from zmqsync._lifecycle import exit_on_sigterm

exit_on_sigterm()

class Finalized:
    def __init__(self, error):
        self.error = error

    def __del__(self):
        if self.error:
            raise ValueError("a finalizer's own error")
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # the handler runs here: its SystemExit is dropped
            pass

Finalized(error=True)
Finalized(error=False)
print("went on", flush=True)
time.sleep(30)
print("SIGTERM lost", flush=True)
"""


def test_a_sigterm_dropped_inside_a_finalizer_is_sent_again():
    # Python drops an exception raised inside a finalizer (a signal's lands wherever the
    # main thread is); SIGTERM's comes again a moment later, in the main thread's own
    # code. Any other exception dropped there is reported as before.
    done = subprocess.run(
        [sys.executable, "-c", DROPPED], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 143, done.stdout + done.stderr
    assert done.stdout == "went on\n"
    assert "ValueError: a finalizer's own error" in done.stderr
    assert "SystemExit" not in done.stderr, done.stderr
