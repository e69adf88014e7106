"""A dataset loader and a model factory of your own: scikit-learn's wine data and a small MLP.

    export PREFECT_ML_ALLOWED_MODULES=examples
    prefect-ml train --dataset examples.wine:load --model examples.wine:build \\
        --model-options '{"width": 128}' --model-name wine-classifier

The tutorial "Your own model and data" (docs/tutorials/own-model.md) shows this file.
"""

import math

import numpy as np
import torch
from sklearn.datasets import load_wine
from torch import nn


def load() -> tuple[np.ndarray, np.ndarray]:
    """The dataset loader: features ``(n, *sample_shape)`` and labels ``(n,)``."""
    features, labels = load_wine(return_X_y=True)  # 178 rows, 13 features, 3 classes
    return features.astype(np.float32), labels


def build(input_shape: tuple[int, ...], num_classes: int, *, width: int = 64) -> torch.nn.Module:
    """The model factory: logits of shape ``(batch, num_classes)``."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(math.prod(input_shape), width),
        nn.ReLU(),
        nn.Linear(width, num_classes),
    )
