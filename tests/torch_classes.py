"""Small nn.Module classes the torch frontend tests load by name (``--model-class torch_classes:Net``).

This module must be importable by the irgen process: the tests put this folder
on ``sys.path`` / ``PYTHONPATH``.
"""

from __future__ import annotations

import torch
from torch import nn


class Net(nn.Module):
    """conv+relu, maxpool, flatten, linear; ``width`` is a constructor argument."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, width, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(width * 4 * 4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.conv(x)))
        return self.fc(torch.flatten(x, 1))


class NotAModule:
    pass


class Recurrent(nn.Module):
    """A two-layer LSTM (torch's quantize_dynamic replaces it by its dynamic int8 LSTM)."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 8, num_layers=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lstm(x)[0]
