"""The pre-flight check of a model, before any run starts or any worker is placed."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from prefect_ml.integrations import datasets, training
from prefect_ml.integrations.errors import PrefectMLError, TrainingCodeError
from prefect_ml.tasks.data import PreparedData
from prefect_ml.tasks.params import TrainingSections

if TYPE_CHECKING:
    import torch

T = TypeVar("T")


def check_model(params: TrainingSections, data: PreparedData) -> training.Probe | None:
    """Refuse, before any run starts, a model that cannot train as asked: one whose factory
    raises, one without the ``--gradient-checkpointing`` hook, or one whose own hooks
    (integrations.training: steps, ``configure_optimizers``, ``compute_loss``,
    ``compute_metrics``) break their contract. Returns what a hooked model's steps log.

    The model is built on torch's meta device when it can be (no memory, no initialisation
    cost), else on the CPU: a model whose construction computes with tensors (``.item()``,
    pretrained weights) fails on meta but is valid. A model with hooks is built on the CPU and
    tried once on two training rows, so a hook that returns the wrong thing fails here, naming
    the hook, not in every worker. An error of the user's code is a :class:`TrainingCodeError`,
    which no retry repeats.
    """
    import torch

    def build() -> torch.nn.Module:
        options = params.model.factory_options()
        return datasets.build_model(
            params.model.model, data.sample_shape, data.num_classes, options
        )

    try:
        with torch.device("meta"):
            model = build()
    except Exception:  # the meta device is only an optimisation: build it for real
        model = _users_code(build, params, "its factory")
    if params.training.gradient_checkpointing:
        datasets.check_gradient_checkpointing(model)
    section = params.training
    if section.strategy in training.SIZE_FIELDS and isinstance(section.workers, int):
        size = getattr(section, training.SIZE_FIELDS[section.strategy]) or section.workers
        training.check_split(model, section.strategy, size)
    own = [
        name for name in ("compute_loss", "compute_metrics") if callable(getattr(model, name, None))
    ]
    if not (training.is_hooked(model) or own):
        return None
    if training.is_hooked(model):
        training.check_contract(model, strategy=params.training.strategy)
    if next(iter(model.parameters()), torch.empty(0)).is_meta:
        model = _users_code(build, params, "its factory")
    rows, raw_labels = data.shard("train").head(2)
    targets = data.problem.targets(raw_labels, data.target_mean, data.target_std)
    features, labels = torch.from_numpy(rows), torch.from_numpy(targets)
    if training.is_hooked(model):
        epochs = params.training.epochs
        return _users_code(
            lambda: training.probe_steps(model, features, labels, epochs), params, "its hooks"
        )

    def steps() -> None:
        loss = training.loss_function(model, data.problem)(model(features), labels)
        training.check_loss(loss, model, "compute_loss")
        if extra := training.metrics_function(model):
            with torch.no_grad():
                training.checked_metrics(extra(model(features), labels), model, "compute_metrics")

    _users_code(steps, params, "its loss and metrics")
    return None


def _users_code(call: Callable[[], T], params: TrainingSections, what: str) -> T:
    """``call()``, with an exception of the user's model code (not one of prefect-ml's, which
    names its field already) as a :class:`TrainingCodeError`: deterministic, never retried."""
    try:
        return call()
    except PrefectMLError:
        raise
    except Exception as exc:
        raise TrainingCodeError(
            f"the model {params.model.model} failed the pre-flight check of {what} on two "
            f"training rows, before any worker started: {type(exc).__name__}: {exc}. Fix the "
            "model's code; no retry would change this"
        ) from exc
