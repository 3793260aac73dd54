# ruff: noqa
# fmt: off
# Copyright (c) Meta Platforms, Inc. and affiliates.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""torchrl's own tests of ``WeightSyncScheme.from_backend``.

Vendored from pytorch/rl, ``test/test_collectors.py`` at commit
ae9719f17b1517af5c2523a36c4616f003ee55cf (torchrl 0.14; the release this repository pins,
0.14.1, has the same registry), MIT License, Copyright (c) Meta Platforms, Inc. and
affiliates. The three tests are copied unchanged; only the imports are cut down to what
they use. ``tests/test_torchrl_from_backend.py`` runs them with zmqsync's scheme
registered as the "zmq" backend, and runs the same bodies for "zmq".
"""
from __future__ import annotations

import pytest
from torchrl.weight_update import (
    DistributedWeightSyncScheme,
    MultiProcessWeightSyncScheme,
    NoWeightSyncScheme,
    RayWeightSyncScheme,
    RPCWeightSyncScheme,
    SharedMemWeightSyncScheme,
    WeightSyncScheme,
)


@pytest.mark.parametrize(
    ("backend", "scheme_cls"),
    [
        ("none", NoWeightSyncScheme),
        ("direct", NoWeightSyncScheme),
        ("shared", SharedMemWeightSyncScheme),
        ("thread", SharedMemWeightSyncScheme),
        ("process", MultiProcessWeightSyncScheme),
        ("multiprocessing", MultiProcessWeightSyncScheme),
        ("distributed", DistributedWeightSyncScheme),
        ("rpc", RPCWeightSyncScheme),
        ("ray", RayWeightSyncScheme),
    ],
)
def test_weight_sync_scheme_from_backend(backend, scheme_cls):
    scheme = WeightSyncScheme.from_backend(backend)
    assert isinstance(scheme, scheme_cls)


def test_weight_sync_scheme_from_backend_forwards_kwargs():
    scheme = WeightSyncScheme.from_backend("shared", sync=False)
    assert isinstance(scheme, SharedMemWeightSyncScheme)
    assert not scheme.sync


def test_weight_sync_scheme_from_backend_rejects_unknown():
    with pytest.raises(ValueError, match="Unsupported weight-sync backend"):
        WeightSyncScheme.from_backend("unknown")
