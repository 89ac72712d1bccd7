"""The model definition torch-model-archiver's --model-file expects: exactly one nn.Module class."""

import torch
from torch import nn


class TinyClassifier(nn.Module):
    """4 features → 3 classes. Weights come from make_weights.py (never committed)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)
