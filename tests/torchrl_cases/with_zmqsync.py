"""The vendored collector cases with ZmqWeightSyncScheme as SharedMemWeightSyncScheme."""

from tests.torchrl_cases import load_cases
from zmqsync.integrations.torchrl import ZmqWeightSyncScheme as SCHEME_UNDER_TEST

__all__ = ["SCHEME_UNDER_TEST"]

load_cases(globals())
