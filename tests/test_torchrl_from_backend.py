"""torchrl's own tests of its weight-sync backend registry (vendored unchanged in
``tests/torchrl_cases/from_backend.py``), run with zmqsync's scheme registered as "zmq":
registering it must leave every torchrl backend as it was; and the same test bodies run
for "zmq" itself."""

from __future__ import annotations

import pytest

pytest.importorskip("torchrl")

import zmqsync.integrations.torchrl  # noqa: E402, F401 - registers the "zmq" backend
from tests.torchrl_cases import from_backend as torchrl_own  # noqa: E402
from tests.torchrl_cases.from_backend import (  # noqa: E402, F401 - torchrl's, unchanged
    test_weight_sync_scheme_from_backend,
    test_weight_sync_scheme_from_backend_forwards_kwargs,
    test_weight_sync_scheme_from_backend_rejects_unknown,
)
from zmqsync.integrations.torchrl import ZmqWeightSyncScheme  # noqa: E402


def test_torchrl_own_from_backend_test_for_zmq():
    torchrl_own.test_weight_sync_scheme_from_backend("zmq", ZmqWeightSyncScheme)


def test_torchrl_own_forwards_kwargs_test_for_zmq():
    """torchrl's body with "shared" and its class replaced by "zmq" and ours."""
    scheme = torchrl_own.WeightSyncScheme.from_backend("zmq", sync=False)
    assert isinstance(scheme, ZmqWeightSyncScheme)
    assert not scheme.sync
    assert torchrl_own.WeightSyncScheme.from_backend("zmq").sync  # background: waits
