"""Methods handed to another thread without keeping their object alive.

A `Subscriber` gives its agent thread callables, not itself: one dropped without
``close()`` must still be collectable (torchrl never closes its schemes), and its
finalizer then stops the agent. A call after that raises ReferenceError, which the
agent takes as the end.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Concatenate, ParamSpec, TypeVar

__all__ = ["weakly", "weakly_1"]

_P = ParamSpec("_P")
_A = TypeVar("_A")
_R = TypeVar("_R")
_S = TypeVar("_S")


def weakly(obj: _S, method: Callable[Concatenate[_S, _P], _R]) -> Callable[_P, _R]:
    """``obj.method`` without keeping `obj` alive: once it is collected, a call raises
    ReferenceError (as a `weakref.proxy` would)."""
    ref = weakref.ref(obj)

    def call(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        target = ref()
        if target is None:
            raise ReferenceError("the Subscriber was collected")
        return method(target, *args, **kwargs)

    return call


def weakly_1(obj: _S, method: Callable[[_S, _A], _R]) -> Callable[[_A], _R]:
    """`weakly` for a method of one argument, passed without packing it in a tuple:
    the apply runs once per version, and ``*args`` cost it ~0.1 us."""
    ref = weakref.ref(obj)

    def call(arg: _A) -> _R:
        target = ref()
        if target is None:
            raise ReferenceError("the Subscriber was collected")
        return method(target, arg)

    return call
