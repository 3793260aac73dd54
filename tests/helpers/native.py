"""The native extension in tests: skipped where it is not built, unless CI requires it.

``.ci/run`` sets ZMQSYNC_REQUIRE_NATIVE=1: there a test that needs the extension and
does not find it fails instead of skipping, so a build that silently dropped the
optional extension cannot pass CI with the C untested.
"""

from __future__ import annotations

import os
from typing import Any, NoReturn

import pytest

REQUIRED = os.environ.get("ZMQSYNC_REQUIRE_NATIVE") == "1"


def missing(
    reason: str = "the native extension is not built", *, at_module_level: bool = False
) -> NoReturn:
    """Skip the test for `reason`, or fail it where the extension is required."""
    if REQUIRED:
        pytest.fail(f"ZMQSYNC_REQUIRE_NATIVE=1 but {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=at_module_level)


def module(*, at_module_level: bool = False) -> Any:
    """``zmqsync._native``, or a skip (a failure where it is required)."""
    try:
        from zmqsync import _native
    except ImportError:
        missing(at_module_level=at_module_level)
    return _native
