"""The training contract for user code: a model that brings its own training and validation
steps, shaped like a Lightning ``LightningModule`` and accepted by duck typing.

A model factory (``--model my_pkg.models:build``) may return a plain ``nn.Module``: the task
type then supplies the loss and the metrics (see :mod:`integrations.problems`), which is the
default implementation of this contract. Or it returns a module that also defines the hooks
below, and prefect-ml calls them instead, under the same data-parallel strategy, precision,
checkpointing, resume and retention::

    import torch
    from torch import nn


    class Regressor(nn.Module):  # or lightning.LightningModule: it fits the same contract
        def __init__(self, input_shape, num_classes):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(input_shape[0], 32), nn.ReLU(), nn.Linear(32, 1))

        def forward(self, x):  # what evaluation and serving call: raw features in
            return self.net(x)

        def training_step(self, batch, batch_idx):
            features, targets = batch
            return nn.functional.huber_loss(self(features).squeeze(1), targets)

        def validation_step(self, batch, batch_idx):
            features, targets = batch
            error = self(features).squeeze(1) - targets
            return {"loss": error.pow(2).mean(), "mae": error.abs().mean()}

        def configure_optimizers(self):  # optional: else --optimizer/--lr/--weight-decay
            return torch.optim.AdamW(self.parameters(), lr=3e-3)


    def build(input_shape, num_classes):
        return Regressor(input_shape, num_classes)

A batch is ``(features, targets)``: a float32 tensor of ``(batch, *sample_shape)`` and the
task's targets (class ids, or regression targets standardised as the data was prepared); a
model with ``batch_format = "dict"`` gets ``{"features": ..., "targets": ...}`` instead.
``validation_step`` metrics are logged as ``val_<name>`` (batch-size-weighted means over every
worker's validation rows) next to the task's own, which ``forward`` still provides: evaluation,
registration and serving call ``forward``. Hooked models train with ``--strategy ddp`` (the
steps run inside DDP's forward); FSDP is refused for them.

Two simpler hooks keep the task's steps and change one part, on a plain model: a
``compute_loss(outputs, targets)`` method replaces the task's loss, and a
``compute_metrics(outputs, targets)`` method returning a dict of scalar tensors adds
validation metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from prefect_ml.integrations.errors import ConfigurationError

if TYPE_CHECKING:
    import torch

    from prefect_ml.integrations.problems import Problem


@runtime_checkable
class TrainingModule(Protocol):
    """A model that brings its own steps; ``configure_optimizers()`` is optional."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """The loss of one batch: a scalar tensor that backpropagates to the parameters."""
        ...

    def validation_step(self, batch: Any, batch_idx: int) -> Mapping[str, torch.Tensor]:
        """Metrics of one batch, each a scalar tensor (a mean over the batch)."""
        ...


def loss_function(model: Any, problem: Problem) -> Callable[[Any, Any], torch.Tensor]:
    """The model's ``compute_loss(outputs, targets)`` (the simpler hook: the task's step with
    another loss), else the task's loss."""
    hook = getattr(model, "compute_loss", None)
    return hook if callable(hook) else problem.loss


def metrics_function(model: Any) -> Callable[[Any, Any], Mapping[str, torch.Tensor]] | None:
    """The model's ``compute_metrics(outputs, targets)``: validation metrics it adds to the
    task's (the simpler hook), or None."""
    hook = getattr(model, "compute_metrics", None)
    return hook if callable(hook) else None


def batch_of(model: Any, features: torch.Tensor, targets: torch.Tensor) -> Any:
    """A batch as the model's hooks take it: ``(features, targets)``, or with
    ``batch_format = "dict"`` on the model ``{"features": ..., "targets": ...}``."""
    if getattr(model, "batch_format", "tuple") == "dict":
        return {"features": features, "targets": targets}
    return features, targets


def is_hooked(model: Any) -> bool:
    """Whether ``model`` brings its own training step."""
    return callable(getattr(model, "training_step", None))


def check_contract(model: Any, *, strategy: str) -> None:
    """Refuse a hooked model that cannot train here, naming the hook and the fix."""
    if not callable(getattr(model, "validation_step", None)):
        raise ConfigurationError(
            "model.model",
            f"{type(model).__name__} defines training_step but no validation_step(batch, "
            "batch_idx) returning a dict of metrics; add it (see integrations/hooks.py)",
        )
    if strategy == "fsdp":
        raise ConfigurationError(
            "training.strategy",
            f"{type(model).__name__} brings its own training_step, which FSDP cannot shard "
            "around; use --strategy ddp",
        )
    if strategy in ("tp", "pp"):
        raise ConfigurationError(
            "training.strategy",
            f"{type(model).__name__} brings its own training_step, and --strategy {strategy} "
            "splits a forward, not a step; use --strategy ddp, or train the model with the "
            "task's loss (compute_loss) instead of a training_step",
        )


def check_loss(loss: Any, model: Any, hook: str = "training_step") -> None:
    """``training_step`` (or ``compute_loss``) returned a scalar tensor that backpropagates."""
    import torch

    if not (isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.requires_grad):
        what = (
            f"a tensor of shape {list(loss.shape)} (requires_grad={loss.requires_grad})"
            if isinstance(loss, torch.Tensor)
            else type(loss).__name__
        )
        raise ConfigurationError(
            f"model.{hook}",
            f"{type(model).__name__}.{hook} must return the batch's loss as a scalar "
            f"tensor that requires grad, got {what}",
        )


def checked_metrics(
    metrics: Any, model: Any, hook: str = "validation_step"
) -> dict[str, torch.Tensor]:
    """``validation_step``'s (or ``compute_metrics``') dict of scalar tensors, keyed
    ``val_<name>``."""
    import torch

    if not isinstance(metrics, Mapping) or not all(
        isinstance(v, torch.Tensor) and v.dim() == 0 for v in metrics.values()
    ):
        raise ConfigurationError(
            f"model.{hook}",
            f"{type(model).__name__}.{hook} must return a dict of scalar tensors, "
            f"got {type(metrics).__name__}",
        )
    return {
        name if name.startswith("val_") else f"val_{name}": value.detach().double()
        for name, value in sorted(metrics.items())
    }


def step_module(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` behind a ``forward(batch, batch_idx, validating)`` that runs its hooks, so
    that a DDP wrapper around it sees each step as its forward (DDP prepares the gradient
    reduction there)."""
    from torch import nn

    class StepModule(nn.Module):
        def __init__(self, network: nn.Module) -> None:
            super().__init__()
            self.network = network

        def forward(self, batch: Any, batch_idx: int, validating: bool = False) -> Any:
            if validating:
                return self.network.validation_step(batch, batch_idx)  # type: ignore[operator]
            return self.network.training_step(batch, batch_idx)  # type: ignore[operator]

    return StepModule(model)


def configured_optimizer(model: Any) -> torch.optim.Optimizer | None:
    """The optimiser ``configure_optimizers()`` returns (alone, first of a list, or under the
    ``"optimizer"`` key), or None without the hook."""
    import torch

    hook = getattr(model, "configure_optimizers", None)
    if not callable(hook):
        return None
    configured = hook()
    if isinstance(configured, Mapping):
        configured = configured.get("optimizer")
    if isinstance(configured, list | tuple) and configured:
        configured = configured[0]
    if not isinstance(configured, torch.optim.Optimizer):
        raise ConfigurationError(
            "model.configure_optimizers",
            f"{type(model).__name__}.configure_optimizers must return a torch optimizer (or "
            f"{{'optimizer': ...}}), got {type(configured).__name__}",
        )
    return configured
