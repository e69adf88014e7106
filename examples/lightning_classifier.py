"""A ``lightning.LightningModule`` written as Lightning's documentation writes it, trained by
prefect-ml unchanged: ``self.log`` in its steps, nothing returned from ``validation_step``, a
``StepLR`` scheduler stepped every epoch, a shape computed with tensors in ``__init__``, a
``test_step`` that evaluation runs and a ``predict_step`` that serving runs.

    export PREFECT_ML_ALLOWED_MODULES=examples
    prefect-ml train --model examples.lightning_classifier:build --workers 2 --epochs 6 \\
        --early-stopping-patience 2 --early-stopping-metric val_acc --early-stopping-mode max
    prefect-ml serve                                   # POST /predict {"inputs": [[...64 pixels]]}

See docs/how-to/lightning.md for what prefect-ml does with each part.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn


class LitClassifier(L.LightningModule):
    def __init__(
        self,
        input_shape: tuple[int, ...],
        num_classes: int,
        hidden: int = 64,
        lr: float = 0.1,
        temperature: float = 2.0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        width = int(torch.tensor(input_shape).prod())  # a tensor computation: not on "meta"
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # type: ignore[no-any-return]

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> Any:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True, logger=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
        acc = (logits.argmax(dim=1) == y).float().mean()
        self.log("val_acc", acc, prog_bar=True, sync_dist=True)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("test_acc", (self(x).argmax(dim=1) == y).float().mean())

    def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self(batch) / self.hparams.temperature  # calibrated logits for serving

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"},
        }


def build(input_shape: tuple[int, ...], num_classes: int, **kwargs: Any) -> LitClassifier:
    """The factory prefect-ml calls: ``--model-options '{"hidden": 128}'`` reaches ``kwargs``."""
    return LitClassifier(input_shape, num_classes, **kwargs)
