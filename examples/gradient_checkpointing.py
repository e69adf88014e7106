"""A model that is not an ``nn.Sequential`` and opts in to gradient checkpointing: with
``--gradient-checkpointing`` prefect-ml calls its ``gradient_checkpointing_enable()`` (the name
Hugging Face models use), and from then on ``forward`` recomputes each block's activations in
backward instead of keeping them.

    export PREFECT_ML_ALLOWED_MODULES=examples
    prefect-ml train --model examples.gradient_checkpointing:build --gradient-checkpointing
"""

import math

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class Net(nn.Module):
    """Residual blocks of one width between an input layer and a classifier head."""

    def __init__(self, features: int, num_classes: int, width: int, blocks: int) -> None:
        super().__init__()
        self.stem = nn.Linear(features, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU())
            for _ in range(blocks)
        )
        self.head = nn.Linear(width, num_classes)
        self.checkpointing = False

    def gradient_checkpointing_enable(self) -> None:
        self.checkpointing = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x.flatten(1))
        for block in self.blocks:
            if self.checkpointing and self.training:
                x = x + checkpoint(block, x, use_reentrant=False)
            else:
                x = x + block(x)
        return self.head(x)


def build(
    input_shape: tuple[int, ...], num_classes: int, *, width: int = 64, blocks: int = 4
) -> Net:
    """The model factory: logits of shape ``(batch, num_classes)``."""
    return Net(math.prod(input_shape), num_classes, width, blocks)
