"""The step: one optimiser step on one batch, the hot path of every worker.

Its precision (an autocast context; fp16 with a gradient scaler), the task's loss or the
model's own ``training_step``, the backward pass, the optimiser and its per-batch schedules,
or under ``pp`` this rank's share of the pipeline's schedule. Nothing here runs per step that
the step does not need: no host sync, no logging, no checkpoint work.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from prefect_ml.integrations.errors import ConfigurationError, ModelStepError
from prefect_ml.integrations.training import _hooks, _model_parallel, _optimization, _step_log

if TYPE_CHECKING:
    import torch

    from prefect_ml.integrations.config.loop import TrainLoop

PRECISIONS = {"fp32": None, "bf16": "bfloat16", "fp16": "float16"}


def precision_context(precision: str, device: torch.device) -> Any:
    """The autocast context of the training and evaluation forwards (a no-op for fp32)."""
    import torch

    dtype = PRECISIONS[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=getattr(torch, dtype))


def check_precision(precision: str, device: torch.device) -> None:
    """Refuse a precision the worker's device cannot train in, before the first step."""
    import torch

    if precision == "fp16" and device.type == "cpu":
        raise ConfigurationError(
            "training.precision",
            "fp16 needs a GPU (its gradient scaler and kernels are GPU features); "
            "use --precision bf16 on CPU, or --use-gpu",
        )
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigurationError(
            "training.precision",
            f"{torch.cuda.get_device_name(device)} has no bf16 support; use --precision fp16",
        )


class Stepper:
    """One worker's training step, called once per batch: :meth:`__call__` returns the
    batch's mean loss, detached, on the device (zero on the ranks of a model replica that do
    not report it).

    ``model`` is what a step calls (the strategy's wrapper; a hooked model's step module),
    ``network`` the model itself. Under tp and pp the first step is measured
    (:func:`model_parallel.measured`) for the communication the epoch reports
    (``communication``).
    """

    def __init__(
        self,
        config: TrainLoop,
        *,
        model: torch.nn.Module,
        network: torch.nn.Module,
        hooked: bool,
        loss: Any,
        pipeline: _model_parallel.Pipeline | None,
        optimizing: _optimization.Optimization,
        scaler: torch.amp.GradScaler,
        device: torch.device,
        log: _step_log.StepLog,
        loop_state: _hooks.LoopState | None,
        reports: bool,
        measures: bool,
    ) -> None:
        self.config, self.model, self.network, self.pipeline = config, model, network, pipeline
        self.optimization, self.optimizer = optimizing, optimizing.optimizer
        self.scaler, self.device, self.step_log, self.loop_state = scaler, device, log, loop_state
        self.precision = config.training.precision
        self.hooked, self.loss = hooked, loss  # loss: the task's or the model's compute_loss
        self.reports, self.measures = reports, measures
        self.communication: _model_parallel.Communication | None = None  # of one step, tp/pp
        # A RuntimeError in the forward of this process's first step is the model's own (a
        # shape its layers do not take): the same on every retry, so it ends the run.
        self.stepped = False

    def __call__(self, step: int, features: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.communication is None and self.measures:
            with _model_parallel.measured(self.pipeline) as measured:
                loss = self._step(step, features, targets)
            self.communication = measured[0]
            return loss
        return self._step(step, features, targets)

    def _step(self, step: int, features: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        model, scaler = self.model, self.scaler
        self.optimizer.zero_grad(set_to_none=True)
        if self.pipeline is not None:  # forward and backward run inside the schedule
            with precision_context(self.precision, self.device):
                loss = self.pipeline.train_step(features, targets)
            self.optimizer.step()
            return loss
        try:
            with precision_context(self.precision, self.device):
                if self.hooked:
                    self.step_log.enter("training_step", len(targets))
                    returned = model(_hooks.batch_of(self.network, features, targets), step)
                    self.step_log.enter(None)
                    loss = _hooks.step_loss(returned, self.network, checked=not self.stepped)
                else:
                    loss = self.loss(model(features), targets)
        except RuntimeError as exc:
            if self.stepped:
                raise
            raise ModelStepError(
                f"the model {self.config.model.model} failed its first training step on this "
                f"worker (a batch of shape {list(features.shape)}, the data's sample shape "
                f"{list(self.config.data.sample_shape)}): {exc}. Fix the model so that its forward "
                "and loss run on such a batch"
            ) from exc
        scaler.scale(loss).backward()
        scaler.step(self.optimizer)
        scaler.update()
        self.optimization.after_batch(step)
        if self.loop_state is not None:
            self.loop_state.global_step += 1
        self.stepped = True
        return loss.detach() if self.reports else loss.detach() * 0.0
