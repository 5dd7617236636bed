"""A plain MLP regression model with deliberately odd sizes (uneven shards everywhere)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    """``Linear -> tanh -> ... -> Linear``; ``model(x, y)`` returns the mean squared error."""

    def __init__(self, sizes: Sequence[int] = (7, 13, 11, 5), seed: int | None = 0):
        super().__init__()
        if seed is not None:
            torch.manual_seed(seed)
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x if y is None else F.mse_loss(x, y)


def regression_batch(sizes: Sequence[int], batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, sizes[0], generator=g), torch.randn(batch, sizes[-1], generator=g)
