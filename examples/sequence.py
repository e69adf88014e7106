"""A non-tabular model with its own training step: a GRU over token sequences.

The task: does token ``MARKER`` appear in the first half of the sequence? The model embeds the
tokens, runs a GRU and classifies its last state. It brings its own ``training_step`` (cross
entropy with label smoothing), ``validation_step`` and ``configure_optimizers``, and takes its
batches as a dict (``batch_format = "dict"``). Its ``forward`` takes the tokens as numbers (the
form every prefect-ml dataset and ``/predict`` row has) and casts them to ids, so the registered
model serves rows of token ids.

    export PREFECT_ML_ALLOWED_MODULES=examples
    prefect-ml train --dataset examples.sequence:load --model examples.sequence:build \\
        --no-normalize --workers 2 --epochs 8 --model-name token-marker
    prefect-ml serve --model-name token-marker      # POST /predict {"inputs": [[3, 17, ...]]}

``--no-normalize`` keeps the token ids as they are (standardising ids would scramble them).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

VOCABULARY = 24
LENGTH = 16
MARKER = 5


def load(rows: int = 1200, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Random token sequences; the label says whether ``MARKER`` is in the first half."""
    generator = np.random.default_rng(seed)
    tokens = generator.integers(0, VOCABULARY, size=(rows, LENGTH))
    tokens[tokens == MARKER] = MARKER + 1  # markers are placed, not drawn
    labels = generator.integers(0, 2, size=rows)
    first_half = generator.integers(0, LENGTH // 2, size=rows)
    second_half = generator.integers(LENGTH // 2, LENGTH, size=rows)
    tokens[np.arange(rows), np.where(labels == 1, first_half, second_half)] = MARKER
    return tokens.astype(np.float32), labels


class TokenClassifier(nn.Module):
    """Embedding, GRU, linear head: a LightningModule-shaped model (no Lightning needed)."""

    batch_format = "dict"

    def __init__(self, num_classes: int, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCABULARY, width)
        self.gru = nn.GRU(width, width, batch_first=True)
        self.head = nn.Linear(width, num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        ids = tokens.long().clamp(0, VOCABULARY - 1)
        _, last = self.gru(self.embed(ids))
        return self.head(last[-1])  # type: ignore[no-any-return]

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self(batch["features"])
        return nn.functional.cross_entropy(logits, batch["targets"], label_smoothing=0.05)

    def validation_step(
        self, batch: dict[str, torch.Tensor], batch_idx: int
    ) -> dict[str, torch.Tensor]:
        logits = self(batch["features"])
        confident = torch.softmax(logits, dim=1).max(dim=1).values > 0.9
        return {"confident_share": confident.float().mean()}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=5e-3)


def build(input_shape: tuple[int, ...], num_classes: int, **options: Any) -> nn.Module:
    return TokenClassifier(num_classes, width=int(options.get("width", 32)))
