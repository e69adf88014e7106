"""The checks and calls of the training contract for user code
(:class:`~prefect_ml.integrations.contracts.TrainingModule`): whether a model brings its own
steps, the loss and metrics functions the loop calls, the batch it is given, the Lightning
hooks and ``self.trainer`` state, and the probe the driver runs before any worker starts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prefect_ml.integrations.errors import ConfigurationError
from prefect_ml.integrations.training import _step_log
from prefect_ml.integrations.training._step_log import StepLog

if TYPE_CHECKING:
    import torch

    from prefect_ml.integrations.problems import Problem


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


def defines(model: Any, hook: str) -> bool:
    """Whether ``model`` defines ``hook`` itself (a ``LightningModule``'s base class defines
    every hook as a no-op, which does not count)."""
    if not callable(getattr(model, hook, None)):
        return False
    method = getattr(type(model), hook, None)
    return method is None or not getattr(method, "__module__", "").startswith(
        ("lightning.", "pytorch_lightning.")
    )


def is_hooked(model: Any) -> bool:
    """Whether ``model`` brings its own training step."""
    return defines(model, "training_step")


def check_contract(model: Any, *, strategy: str) -> None:
    """Refuse a hooked model that cannot train here, naming the hook and the fix."""
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
            f"tensor that requires grad (or a dict holding it under 'loss'), got {what}",
        )


def step_loss(returned: Any, model: Any, *, checked: bool = True) -> torch.Tensor:
    """The loss ``training_step`` returned: the tensor, or a dict's ``"loss"`` (as Lightning
    takes it), as float32; ``checked`` verifies it first (:func:`check_loss`)."""
    loss = returned.get("loss") if isinstance(returned, Mapping) else returned
    if checked:
        check_loss(loss, model)
    return loss.float()  # type: ignore[no-any-return,union-attr]


def checked_metrics(
    metrics: Any, model: Any, hook: str = "validation_step"
) -> dict[str, torch.Tensor]:
    """``validation_step``'s (or ``compute_metrics``') dict of scalar tensors, keyed
    ``val_<name>`` (``test_step``'s: ``test_<name>``); a step that returns nothing (it logs)
    adds none."""
    import torch

    if metrics is None and hook in ("validation_step", "test_step"):
        return {}
    if not isinstance(metrics, Mapping) or not all(
        isinstance(v, torch.Tensor) and v.dim() == 0 for v in metrics.values()
    ):
        raise ConfigurationError(
            f"model.{hook}",
            f"{type(model).__name__}.{hook} must return a dict of scalar tensors (or "
            f"nothing, logging with self.log), got {type(metrics).__name__}",
        )
    prefix = "test_" if hook == "test_step" else "val_"
    return {
        name if name.startswith(prefix) else f"{prefix}{name}": value.detach().double()
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


@dataclass
class LoopState:
    """What a ``LightningModule`` reads of its trainer (``self.trainer``,
    ``self.current_epoch``, ``self.global_step``, ``self.global_rank``), kept by the loop.

    Epochs count from 0 as in Lightning (prefect-ml's epoch 1 is ``current_epoch`` 0);
    ``global_step`` counts optimiser steps; ``callback_metrics`` holds the last finished
    epoch's metrics as tensors, as Lightning's callbacks read them.
    """

    max_epochs: int
    num_training_batches: int
    world_size: int = 1
    global_rank: int = 0
    current_epoch: int = 0
    global_step: int = 0
    callback_metrics: dict[str, Any] = field(default_factory=dict)
    training: bool = False
    validating: bool = False
    testing: bool = False
    predicting: bool = False
    sanity_checking: bool = False
    should_stop: bool = False
    barebones: bool = False
    logger: Any = None
    loggers: list[Any] = field(default_factory=list)
    lr_scheduler_configs: list[Any] = field(default_factory=list)
    optimizers: list[Any] = field(default_factory=list)
    datamodule: Any = None

    @property
    def estimated_stepping_batches(self) -> int:
        """Optimiser steps of the whole run (what ``OneCycleLR(total_steps=...)`` wants)."""
        return self.max_epochs * self.num_training_batches

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    @property
    def local_rank(self) -> int:
        return self.global_rank

    @property
    def node_rank(self) -> int:
        return 0

    @property
    def num_devices(self) -> int:
        return self.world_size

    @property
    def num_nodes(self) -> int:
        return 1

    @property
    def logged_metrics(self) -> dict[str, Any]:
        return self.callback_metrics

    @property
    def progress_bar_metrics(self) -> dict[str, Any]:
        return self.callback_metrics


def attach(model: Any, log: StepLog, state: LoopState | None) -> None:
    """Route ``model``'s ``self.log``/``self.log_dict`` to ``log`` and, on a
    ``LightningModule``, make ``state`` its trainer (and its child modules')."""
    model.log = log.log
    model.log_dict = log.log_dict
    if state is not None and hasattr(model, "_trainer"):
        model.trainer = state


def call_hook(model: Any, name: str, log: StepLog) -> None:
    """Call ``model``'s epoch hook ``name`` if it defines one, logging into it."""
    if defines(model, name):
        with log.hook(name):
            getattr(model, name)()


@dataclass(frozen=True)
class Probe:
    """What a hooked model's steps did on a first batch: the metric names they return or log
    (``names``) and those logged with ``prog_bar=True``."""

    names: frozenset[str]
    prog_bar: frozenset[str]


def probe_steps(model: Any, features: torch.Tensor, targets: torch.Tensor, epochs: int) -> Probe:
    """Run ``model``'s ``training_step`` (and ``validation_step``) once on a small batch, with
    its logging and trainer attached as in training, and parse ``configure_optimizers()``: a
    hook that breaks its contract fails here, naming the hook."""
    import torch

    from prefect_ml.integrations.training import _optimization

    log = StepLog()
    attach(model, log, LoopState(max_epochs=epochs, num_training_batches=1))
    if defines(model, "configure_optimizers"):
        _optimization.configured(model)
    batch = batch_of(model, features, targets)
    with log.hook("training_step", len(targets)):
        step_loss(model.training_step(batch, 0), model)
    returned: dict[str, torch.Tensor] = {}
    if defines(model, "validation_step"):
        with torch.no_grad(), log.hook("validation_step", len(targets)):
            returned = checked_metrics(model.validation_step(batch, 0), model)
    names = frozenset(returned) | frozenset(log.names())
    prog_bar = frozenset(log.prog_bar)
    log.discard()
    return Probe(names, prog_bar)


def test_step_metrics(
    model: Any, batches: Iterator[tuple[torch.Tensor, torch.Tensor]]
) -> dict[str, float]:
    """What ``model``'s ``test_step`` logs (``self.log``) or returns over ``batches`` of the
    test split, then its ``on_test_epoch_end``, as ``test_<name>`` epoch values; empty for a
    model without ``test_step``. One process: the evaluation's."""
    import torch

    if not defines(model, "test_step"):
        return {}
    log, state = StepLog(), LoopState(max_epochs=0, num_training_batches=0, testing=True)
    attach(model, log, state)
    returned: dict[str, list[float]] = {}
    model.eval()
    with torch.no_grad():
        for batch_idx, (features, targets) in enumerate(batches):
            with log.hook("test_step", len(targets)):
                found = model.test_step(batch_of(model, features, targets), batch_idx)
            for name, value in checked_metrics(found, model, "test_step").items():
                totals = returned.setdefault(name, [0.0, 0.0])
                totals[0] += float(value) * len(targets)
                totals[1] += len(targets)
        call_hook(model, "on_test_epoch_end", log)
    means = {name: total / rows for name, (total, rows) in returned.items() if rows}
    return {**means, **_step_log.combine([log.take()])}


def served_module(model: torch.nn.Module) -> torch.nn.Module:
    """What serving and batch scoring run: ``model``, or with a ``predict_step`` of its own a
    module whose forward is ``predict_step(features, 0)`` (a batch of features, as Lightning's
    default ``predict_step`` takes it)."""
    from torch import nn

    if not defines(model, "predict_step"):
        return model

    class PredictStep(nn.Module):
        def __init__(self, network: nn.Module) -> None:
            super().__init__()
            self.network = network

        def forward(self, features: torch.Tensor) -> Any:
            return self.network.predict_step(features, 0)  # type: ignore[operator]

    return PredictStep(model).eval()
