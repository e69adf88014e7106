"""Tune your own model's options with a define-by-run search space (docs/how-to/search-spaces.md).

    PREFECT_ML_ALLOWED_MODULES=examples prefect-ml sweep --campaign blocks \\
        --model examples.search_space:build --search-space examples.search_space:space

``build`` is an ordinary model factory; ``space`` is what Optuna users write: ``trial.suggest_*``
under an ``if`` and a ``for``, returning what each trial sets.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from torch import nn


class Blocks(nn.Module):
    """Hidden layers of the given widths; with ``residual_scale``, each adds a scaled copy of
    its input where the widths match."""

    def __init__(
        self,
        features: int,
        num_classes: int,
        widths: Sequence[int],
        activation: str,
        residual_scale: float,
    ) -> None:
        super().__init__()
        sizes = [features, *widths]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:], strict=False))
        self.activation = nn.GELU() if activation == "gelu" else nn.ReLU()
        self.head = nn.Linear(sizes[-1], num_classes)
        self.residual_scale = residual_scale

    def forward(self, x: Any) -> Any:
        x = x.flatten(1)
        for layer in self.layers:
            y = self.activation(layer(x))
            x = y + self.residual_scale * x if self.residual_scale and x.shape == y.shape else y
        return self.head(x)


# --8<-- [start:build]
def build(
    input_shape: Sequence[int],
    num_classes: int,
    *,
    blocks: int = 2,
    width: int = 64,
    widths: Sequence[int] | None = None,
    activation: str = "relu",
    residual: bool = False,
    residual_scale: float = 0.5,
) -> nn.Module:
    """``widths`` (one per layer), or ``blocks`` layers of ``width``."""
    return Blocks(
        int(np.prod(input_shape)),
        num_classes,
        list(widths) if widths is not None else [width] * blocks,
        activation,
        residual_scale if residual else 0.0,
    )


# --8<-- [end:build]


# --8<-- [start:space]
def space(trial: Any) -> dict[str, Any]:
    """One width per layer for however many layers were drawn; weight decay only with SGD; a
    residual scale only for residual models."""
    blocks = trial.suggest_int("blocks", 1, 4)
    optimizer = trial.suggest_categorical("optimizer", ["adam", "sgd"])
    values: dict[str, Any] = {
        "lr": trial.suggest_float("lr", 1e-4, 1e-1, log=True),
        "optimizer": optimizer,
        "model_options.widths": [
            trial.suggest_int(f"width_{i}", 16, 256, log=True) for i in range(blocks)
        ],
        "model_options.activation": trial.suggest_categorical("activation", ["relu", "gelu"]),
        "model_options.residual": trial.suggest_categorical("residual", [False, True]),
    }
    if optimizer == "sgd":
        values["weight_decay"] = trial.suggest_float("weight_decay", 1e-6, 1e-2, log=True)
    if values["model_options.residual"]:
        values["model_options.residual_scale"] = trial.suggest_float("residual_scale", 0.1, 1.0)
    return values


# --8<-- [end:space]
