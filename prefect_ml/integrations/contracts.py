"""What your own code implements: every contract prefect-ml calls user code through, in one
place. Each is a :class:`typing.Protocol`, met by duck typing: nothing needs to import this
module or inherit from it.

* :class:`DatasetLoader`: ``loader(**options) -> (features, labels)``, named by
  ``--dataset package.module:loader`` or a ``prefect_ml.datasets`` entry point;
* :class:`ModelFactory`: ``factory(input_shape, num_classes, **options) -> nn.Module``, named by
  ``--model package.module:factory`` or a ``prefect_ml.models`` entry point;
* :class:`TrainingModule`: a model that brings its own training and validation steps (a
  Lightning ``LightningModule`` as Lightning's docs write one fits it);
* :class:`ModelParallelHooks`: a model's own tensor-parallel plan or pipeline cut;
* :class:`SearchSpace`: a campaign's define-by-run search space, named by
  ``--search-space package.module:space`` or a ``prefect_ml.search_spaces`` entry point.

User code named by an import path is allowed by :mod:`integrations.plugins` (a registered entry
point or a module under ``PREFECT_ML_ALLOWED_MODULES``), and resolved and checked (importable,
callable, the right signature) while parameters are parsed, before any compute starts. This
module imports nothing of prefect-ml, so every package may name the contracts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np
    import torch
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle


class DatasetLoader(Protocol):
    """Loads a whole dataset: ``loader(**options) -> (features, labels)``, NumPy arrays,
    ``features`` shaped ``(n, *sample_shape)`` and ``labels`` shaped ``(n,)``: class labels, or
    numbers for ``--task regression``. ``options`` are ``--dataset-option key=value`` (the data
    section's ``dataset_options``); each must be a parameter of the loader."""

    def __call__(self, **options: Any) -> tuple[np.ndarray, np.ndarray]: ...


class ModelFactory(Protocol):
    """Builds the model: ``factory(input_shape, num_classes, **options) -> torch.nn.Module``
    returning ``(batch, num_classes)`` logits; for regression ``num_classes`` is 1 and the
    output ``(batch, 1)`` is the prediction. ``options`` are ``--model-option key=value`` (the
    model section's ``model_options``, which a campaign may tune); each must be a parameter of
    the factory.

    Gradient checkpointing (``--gradient-checkpointing``) works on any ``nn.Sequential`` model;
    any other model opts in by defining ``gradient_checkpointing_enable()`` (the name Hugging
    Face models use), which must make its forward recompute activations in backward instead of
    keeping them, for example by wrapping each block in ``torch.utils.checkpoint.checkpoint(...,
    use_reentrant=False)``. The model may also meet :class:`TrainingModule` (its own steps) and
    :class:`ModelParallelHooks` (its own splits)."""

    def __call__(
        self, input_shape: tuple[int, ...], num_classes: int, **options: Any
    ) -> nn.Module: ...


@runtime_checkable
class TrainingModule(Protocol):
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
    The steps log as a ``LightningModule`` does, with ``self.log``/``self.log_dict`` (see
    :mod:`integrations.training`); metrics ``validation_step`` returns, if it returns any, are
    logged as ``val_<name>`` (batch-size-weighted means over every worker's validation rows). Both
    come next to the task's own, which ``forward`` still provides: evaluation, registration and
    serving call ``forward`` (``test_step`` and ``predict_step``, when the model defines them, add
    test metrics and shape what serving returns). ``configure_optimizers`` may return any form
    Lightning accepts (:mod:`integrations.training`). The loop calls ``on_train_epoch_start``,
    ``on_train_epoch_end``, ``on_validation_epoch_start`` and ``on_validation_epoch_end`` where
    Lightning does; a ``LightningModule`` reads ``self.current_epoch``, ``self.global_step`` and
    ``self.trainer`` (a :class:`LoopState`) as under Lightning's ``Trainer``. Hooked models train
    with ``--strategy ddp`` (the steps run inside DDP's forward); FSDP is refused for them.

    Two simpler hooks keep the task's steps and change one part, on a plain model: a
    ``compute_loss(outputs, targets)`` method replaces the task's loss, and a
    ``compute_metrics(outputs, targets)`` method returning a dict of scalar tensors adds
    validation metrics.

    ``validation_step`` and ``configure_optimizers()`` are optional, as in Lightning.
    """

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """The loss of one batch: a scalar tensor that backpropagates to the parameters."""
        ...

    def validation_step(self, batch: Any, batch_idx: int) -> Mapping[str, torch.Tensor] | None:
        """Metrics of one batch, each a scalar tensor (a mean over the batch), or None (the
        step logs with ``self.log``)."""
        ...


class ModelParallelHooks(Protocol):
    """Optional methods of a user model that tp or pp call instead of the built-in splits.

    Example, a model with two blocks::

        class Net(nn.Module):
            def tensor_parallel_plan(self, tp_mesh):
                return {"up": ColwiseParallel(), "down": RowwiseParallel()}

            def pipeline_stage(self, stage, stages):
                # this model with the other stage's block removed: names stay the full model's
                if stage == 0:
                    self.down = nn.Identity()
                else:
                    self.up = nn.Identity()
                return self
    """

    def tensor_parallel_plan(self, tp_mesh: DeviceMesh) -> dict[str, ParallelStyle]:
        """``parallelize_module``'s plan for this model over the ``tp_mesh`` (1-D) group; the
        model's output must come back replicated (a plain tensor of the full logits)."""
        ...

    def pipeline_stage(self, stage: int, stages: int) -> nn.Module:
        """The module that runs stage ``stage`` of ``stages``: it takes the previous stage's
        output (stage 0: the features) as one tensor and returns one tensor (the last: the
        logits). Its state-dict names must be the full model's (a subset of them)."""
        ...


class SearchSpace(Protocol):
    """A define-by-run search space: called once per trial, on the campaign's coordinator.

    It draws with ``trial`` (an ``optuna.Trial``: ``suggest_float``, ``suggest_int``,
    ``suggest_categorical``) under any control flow, and returns what the trial sets::

        def space(trial):
            blocks = trial.suggest_int("blocks", 1, 4)
            values = {
                "lr": trial.suggest_float("lr", 1e-4, 1e-1, log=True),
                "model_options.widths": [
                    trial.suggest_int(f"width_{i}", 16, 256, log=True) for i in range(blocks)
                ],
            }
            if trial.suggest_categorical("optimizer", ["adam", "sgd"]) == "sgd":
                values["optimizer"] = "sgd"
                values["model_options.momentum"] = trial.suggest_float("momentum", 0.5, 0.99)
            return values

    It must draw the same values again for the same parameters (a retried trial is given its
    first attempt's), so it draws nothing but through ``trial``.
    """

    def __call__(self, trial: Any) -> Mapping[str, Any]: ...
