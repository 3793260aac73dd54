"""Models and deterministic weights shared by tests and their subprocess workers."""

from __future__ import annotations

import torch


class Mixed(torch.nn.Module):
    """bf16 + fp32 + fp16 + int64 + bool, BatchNorm statistics, a non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Linear(16, 32)
        self.norm = torch.nn.BatchNorm1d(32)
        self.head = torch.nn.Linear(32, 4).to(torch.bfloat16)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        self.register_buffer("scale", torch.ones(7, dtype=torch.float16))
        self.register_buffer("mask", torch.zeros(5, dtype=torch.bool))
        self.register_buffer("cache", torch.zeros(3, 3), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.encoder(x)).bfloat16())


def train_step(model: Mixed, seed: int) -> None:
    """Change every tensor, deterministically from `seed` (BatchNorm stats included)."""
    g = torch.Generator().manual_seed(seed)
    model.train()
    with torch.no_grad():
        model(torch.randn(8, 16, generator=g))  # updates running stats + num_batches
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.dtype))
        model.steps += 1
        model.scale.mul_(1.5)
        model.mask.logical_not_()
        model.cache.add_(1)


def filled(template: dict, value: int) -> dict:
    """Every tensor filled with `value`: a reader can tell versions apart element-wise."""
    return {k: torch.full_like(t, value % 100) for k, t in template.items()}
