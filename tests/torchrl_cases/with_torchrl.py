"""The vendored collector cases with torchrl's own SharedMemWeightSyncScheme."""

from torchrl.weight_update import SharedMemWeightSyncScheme as SCHEME_UNDER_TEST

from tests.torchrl_cases import load_cases

__all__ = ["SCHEME_UNDER_TEST"]

load_cases(globals())
