"""The model of the TP worker tests: the trainer holds it whole, the workers
parallelized (`tests/helpers/tp_worker.py`)."""

from __future__ import annotations

import torch

# the input every worker rank computes with, and the test with the full model
INPUT = torch.linspace(-1.0, 1.0, 4 * 16).reshape(4, 16)


class TpNet(torch.nn.Module):
    """fc1(16 -> 30) -> relu -> fc2(30 -> 16); odd(5 -> 13), left out of forward: its
    column shards are uneven on 2 ranks (7 and 6 rows), which DTensor's matmul refuses
    but a slot's slices are not."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 30)
        self.fc2 = torch.nn.Linear(30, 16)
        self.odd = torch.nn.Linear(5, 13)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))
