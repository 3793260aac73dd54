"""torchrl's own collector test cases, run against two weight sync schemes.

``collectors.py`` holds the cases, vendored from pytorch/rl unchanged (see its
docstring). It is executed inside ``with_torchrl`` and ``with_zmqsync``, real modules
that differ only in the scheme bound to ``SharedMemWeightSyncScheme``: torchrl's
worker processes (spawned) import the module a case's classes were defined in, so each
variant must be importable by name.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

CASES = Path(__file__).with_name("collectors.py")


def load_cases(namespace: dict[str, Any]) -> None:
    """Run the vendored cases in `namespace` (a module's globals, with SCHEME_UNDER_TEST)."""
    import pytest

    with warnings.catch_warnings():
        # upstream marks (gpu, flaky) are not registered here, and torchrl's legacy
        # WeightUpdaterBase warns when subclassed
        warnings.simplefilter("ignore", pytest.PytestUnknownMarkWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        exec(compile(CASES.read_text(), str(CASES), "exec"), namespace)  # noqa: S102
