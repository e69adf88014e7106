"""Evaluation: a worker's validation pass after each epoch.

The task's statistics (:func:`evaluate_batches`: its loss and metrics, summed on the device)
and the metrics the model adds (:class:`ModelValidation`: its ``validation_step``, or
``compute_metrics`` of its outputs), summed weighted by batch size; the epoch's one
all-reduce adds the workers' up.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prefect_ml.integrations import problems
from prefect_ml.integrations.training import _hooks, _model_parallel, _step_log

if TYPE_CHECKING:
    import torch

Batches = Iterator[tuple["torch.Tensor", "torch.Tensor"]]


def evaluate_batches(
    model: torch.nn.Module | _model_parallel.Pipeline,
    batches: Batches,
    device: torch.device,
    problem: problems.Problem,
) -> list[torch.Tensor]:
    """The task's summed validation statistics of ``model`` on the given batches; the sums stay
    on the device (no host sync per batch) until the epoch's one all-reduce reads them."""
    import torch

    sums = [
        torch.zeros((), dtype=torch.float64, device=device) for _ in range(problem.validation_width)
    ]  # also what a worker with no validation rows adds
    model.eval()
    with torch.no_grad():
        for features, targets in batches:
            outputs = model(features)
            if outputs is None:  # a pipeline stage before the last: the last one adds them
                continue
            batch = problem.validation_sums(outputs, targets)
            sums = [total + part for total, part in zip(sums, batch, strict=True)]
    return sums


@dataclass(frozen=True)
class ModelValidation:
    """The validation metrics a model adds to its task's: its ``validation_step`` (a hooked
    model's, run through ``model``, the strategy's wrapper of its steps), else its
    ``compute_metrics`` of the outputs of ``network`` (or of the ``pipeline``)."""

    model: torch.nn.Module
    network: torch.nn.Module
    pipeline: _model_parallel.Pipeline | None
    hooked: bool
    extra_metrics: Callable[[Any, Any], Any] | None  # the model's compute_metrics
    log: _step_log.StepLog
    loop_state: _hooks.LoopState | None

    @property
    def adds_metrics(self) -> bool:
        return self.validates or self.extra_metrics is not None

    @property
    def validates(self) -> bool:
        return self.hooked and _hooks.defines(self.network, "validation_step")

    def sums(self, batches: Batches) -> dict[str, torch.Tensor]:
        """The model's metrics over ``batches``, summed weighted by batch size on the device;
        empty for a model without either hook."""
        import torch

        if not self.adds_metrics:
            return {}
        validates = self.validates
        sums: dict[str, torch.Tensor] = {}
        self.model.eval()
        if self.loop_state is not None:
            self.loop_state.validating = True
            _hooks.call_hook(self.network, "on_validation_epoch_start", self.log)
        with torch.no_grad():
            for batch_idx, (features, targets) in enumerate(batches):
                metrics = (
                    self._validation_step(features, targets, batch_idx)
                    if validates
                    else self._computed(features, targets)
                )
                for name, value in (metrics or {}).items():
                    weighted = value * len(targets)
                    sums[name] = sums[name] + weighted if name in sums else weighted
        if self.loop_state is not None:
            _hooks.call_hook(self.network, "on_validation_epoch_end", self.log)
            self.loop_state.validating = False
        return sums

    def _validation_step(
        self, features: torch.Tensor, targets: torch.Tensor, batch_idx: int
    ) -> dict[str, torch.Tensor]:
        batch = _hooks.batch_of(self.network, features, targets)
        with self.log.hook("validation_step", len(targets)):
            found = self.model(batch, batch_idx, True)
        return _hooks.checked_metrics(found, self.network)

    def _computed(
        self, features: torch.Tensor, targets: torch.Tensor
    ) -> dict[str, torch.Tensor] | None:
        assert self.extra_metrics is not None
        outputs = (self.pipeline or self.network)(features)
        if outputs is None:  # a pipeline stage before the last
            return None
        found = self.extra_metrics(outputs, targets)
        return _hooks.checked_metrics(found, self.network, "compute_metrics")

    def covers_the_task(self, problem: problems.Problem, rows: tuple[Any, Any]) -> bool:
        """Whether the model's ``validation_step`` returns or logs every validation metric of
        ``problem`` (asked once, on ``rows``, two validation rows on the device; what it logs
        there is forgotten)."""
        import torch

        if not _hooks.defines(self.network, "validation_step"):
            return False
        batch = _hooks.batch_of(self.network, *rows)
        was_training = self.network.training
        self.network.eval()
        with torch.no_grad(), self.log.hook("validation_step", len(rows[1])):
            found = self.network.validation_step(batch, 0)  # type: ignore[operator]
        returned = set(_hooks.checked_metrics(found, self.network))
        logged = set(self.log.names())
        self.log.discard()
        self.network.train(was_training)
        task = {name for name in problem.epoch_metrics if name.startswith("val_")}
        return task <= returned | logged
