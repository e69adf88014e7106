"""The training section: workers, epochs, optimiser, parallelism, checkpoints, fault tolerance.

Each field says on itself what it is to a run (:class:`Role`): operational fields change how a
run executes, not what it computes, so they stay out of its identity and out of a campaign's
search space.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from prefect_ml.integrations.config._base import Role, fields_with
from prefect_ml.integrations.config.resources import (
    CustomResources,
    Reserve,
    Reserving,
    accelerator_field,
    memory_field,
    resources_field,
)
from prefect_ml.integrations.early_stopping import EarlyStopping

# An epoch metric's name: the task's (val_loss) or one a model logs (val_acc, val/f1).
METRIC_NAME = r"^[A-Za-z][A-Za-z0-9_./-]*$"


class TrainingParams(Reserving):
    """How to train: workers, epochs, optimiser, fault tolerance."""

    workers: Annotated[int | tuple[int, int], Role.OPERATIONAL, Reserve.COUNT] = Field(
        2,
        title="Workers",
        description="Ray Train workers (data-parallel): a number, or a range 'min-max' for "
        "elastic training that starts with min and carries on after losing workers.",
    )
    epochs: int = Field(12, ge=1, title="Epochs", description="Passes over the training split.")
    batch_size: int = Field(
        32, ge=1, title="Batch size", description="Samples per step on each worker."
    )
    lr: float = Field(
        2e-3, gt=0, allow_inf_nan=False, title="Learning rate", description="Initial learning rate."
    )
    optimizer: Literal["adam", "adamw", "sgd"] = Field(
        "adam", title="Optimizer", description="Optimisation algorithm."
    )
    weight_decay: float = Field(
        0.0, ge=0, allow_inf_nan=False, title="Weight decay", description="L2 penalty."
    )
    scheduler: Literal["cosine", "none"] = Field(
        "cosine", title="LR schedule", description="Learning-rate schedule over the epochs."
    )
    seed: int = Field(0, title="Seed", description="Seed for initialisation and shuffling.")
    max_failures: Annotated[int, Role.OPERATIONAL] = Field(
        3,
        ge=0,
        title="Max failures",
        description="Worker failures tolerated; each restarts from the last checkpoint.",
    )
    use_gpu: Annotated[bool, Role.OPERATIONAL, Reserve.GPUS] = Field(
        False, title="Use GPU", description="One GPU per worker, NCCL instead of gloo."
    )
    cpus_per_worker: Annotated[float, Role.OPERATIONAL, Reserve.CPUS] = Field(
        1.0, gt=0, title="CPUs per worker", description="CPUs Ray reserves for each worker."
    )
    accelerator_type: Annotated[str | None, Role.OPERATIONAL, Reserve.ACCELERATOR_TYPE] = (
        accelerator_field("GPU type", "workers", "use_gpu")
    )
    allow_mixed_gpu_types: Annotated[bool, Role.OPERATIONAL] = Field(
        False,
        title="Allow mixed GPU types",
        description="Let one worker group span GPUs of different types (it then runs at the "
        "slowest GPU's pace); otherwise such a cluster needs --accelerator-type.",
    )
    memory_per_worker_gb: Annotated[float | None, Role.OPERATIONAL, Reserve.MEMORY] = memory_field(
        "Memory per worker (GB)", "each worker"
    )
    worker_resources: Annotated[CustomResources, Role.OPERATIONAL, Reserve.CUSTOM] = (
        resources_field("Custom resources per worker", "workers")
    )
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32",
        title="Precision",
        description="Autocast precision: bf16 works on CPU and recent GPUs; fp16 needs a GPU and "
        "adds a gradient scaler.",
    )
    gradient_checkpointing: Annotated[bool, Role.OPERATIONAL] = Field(
        False,
        title="Gradient checkpointing",
        description="Recompute activations in backward instead of keeping them: less memory, "
        "about one more forward per step.",
    )
    strategy: Annotated[Literal["ddp", "fsdp", "tp", "pp"], Role.OPERATIONAL] = Field(
        "ddp",
        title="Parallel strategy",
        description="ddp replicates the model on every worker; fsdp shards parameters, gradients "
        "and optimiser state across workers (FSDP2); tp splits each layer's weights across the "
        "workers of a tensor-parallel group (DTensor); pp puts consecutive layers on the "
        "stages of a pipeline (torch.distributed.pipelining).",
    )
    tensor_parallel_size: Annotated[int, Role.OPERATIONAL] = Field(
        0,
        ge=0,
        title="Tensor-parallel size",
        description="--strategy tp: workers per tensor-parallel group (0: all workers). Fewer "
        "than the workers makes a 2-D mesh: the groups train data-parallel with FSDP.",
    )
    pipeline_parallel_size: Annotated[int, Role.OPERATIONAL] = Field(
        0,
        ge=0,
        title="Pipeline stages",
        description="--strategy pp: stages per pipeline, one worker each (0: all workers). "
        "Fewer than the workers makes a 2-D mesh: the pipelines train data-parallel.",
    )
    pipeline_microbatches: Annotated[int, Role.OPERATIONAL] = Field(
        4,
        ge=1,
        title="Pipeline microbatches",
        description="--strategy pp: microbatches each batch is split into; at most the batch size.",
    )
    pipeline_schedule: Annotated[Literal["1f1b", "gpipe"], Role.OPERATIONAL] = Field(
        "1f1b",
        title="Pipeline schedule",
        description="--strategy pp: 1f1b (one forward, one backward: activations of at most "
        "the stage count in flight) or gpipe (all forwards, then all backwards).",
    )
    checkpoint_layout: Annotated[Literal["auto", "gathered", "sharded"], Role.OPERATIONAL] = Field(
        "auto",
        title="Checkpoint layout",
        description="gathered: rank 0 gathers the whole state and writes it; sharded: every "
        "worker writes its own shards, committed by one manifest once all are verified. auto: "
        "sharded for fsdp, tp and pp, gathered for ddp.",
    )
    checkpoint_every_steps: Annotated[int, Role.OPERATIONAL] = Field(
        0,
        ge=0,
        title="Checkpoint every N steps",
        description="Also commit a checkpoint every N training steps inside an epoch (0: at "
        "epoch ends only); a resumed run restarts at the step after it, in the same data order.",
    )
    checkpoint_every_seconds: Annotated[float, Role.OPERATIONAL] = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        title="Checkpoint every N seconds",
        description="Also commit a checkpoint once this many seconds have passed since the last "
        "one, at the next step (0: off).",
    )
    checkpoint_budget: Annotated[float, Role.OPERATIONAL] = Field(
        0.05,
        ge=0,
        le=1,
        allow_inf_nan=False,
        title="Checkpoint budget",
        description="Most of the training time that checkpoints may take (0.05: 5%; the time "
        "they block the loop and their background writer's CPU time): an "
        "epoch commits its weights only while that holds (a worker group's first and the last "
        "always); "
        "the others commit their metrics only (all reach MLflow) and a resumed run replays "
        "them from the last epoch with weights. The best epoch's weights are kept. 0: every "
        "epoch commits its weights.",
    )
    collective_timeout_s: Annotated[int, Role.OPERATIONAL] = Field(
        1800,
        ge=10,
        title="Collective timeout (s)",
        description="How long a collective waits for a lost or hung worker before the group fails "
        "and restarts from the last checkpoint.",
    )
    elastic_resize_s: Annotated[float, Role.OPERATIONAL] = Field(
        60.0,
        gt=0,
        title="Elastic resize check (s)",
        description="Elastic runs ('min-max' workers): how often a healthy group below max looks "
        "for room to grow (Ray Train's elastic_resize_monitor_interval_s); growing restarts the "
        "group from the last checkpoint.",
    )
    keep_checkpoints: Annotated[int, Role.OPERATIONAL] = Field(
        3,
        ge=1,
        title="Checkpoints kept",
        description="Newest checkpoints that keep their weights; older ones keep only their "
        "metrics (the best one by the best-checkpoint metric is kept too).",
    )
    best_checkpoint_metric: Annotated[str, Role.OPERATIONAL] = Field(
        "val_loss",
        pattern=METRIC_NAME,
        title="Best-checkpoint metric",
        description="Epoch metric whose best epoch keeps its weights whatever its age: one the "
        "task type produces (val_loss, val_accuracy, val_rmse, val_mae, val_r2) or, for a "
        "model of your own, one it logs with self.log; 'none' keeps only the newest.",
    )
    best_checkpoint_mode: Annotated[Literal["auto", "min", "max"], Role.OPERATIONAL] = Field(
        "auto",
        title="Best-checkpoint mode",
        description="Whether the best-checkpoint metric is best when lowest (min) or highest "
        "(max); auto: the task metric's direction, min for any other (as Lightning's "
        "ModelCheckpoint).",
    )
    early_stopping_patience: Annotated[int | None, Role.EARLY_STOPPING] = Field(
        None,
        ge=0,
        title="Early-stopping patience",
        description="Stop once the early-stopping metric has not improved by the min delta for "
        "this many epochs; the best epoch's weights are then evaluated and registered. 0 or "
        "unset: train every epoch.",
    )
    early_stopping_min_delta: Annotated[float, Role.EARLY_STOPPING] = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        title="Early-stopping min delta",
        description="How much an epoch must beat the best value so far to count as improving.",
    )
    early_stopping_metric: Annotated[str | None, Role.EARLY_STOPPING] = Field(
        None,
        pattern=METRIC_NAME,
        title="Early-stopping metric",
        description="Epoch metric early stopping watches: one the task type produces or one "
        "your model logs with self.log; by default the best-checkpoint metric (val_loss when "
        "that is 'none').",
    )
    early_stopping_mode: Annotated[Literal["auto", "min", "max"], Role.EARLY_STOPPING] = Field(
        "auto",
        title="Early-stopping mode",
        description="Whether the early-stopping metric improves downwards (min) or upwards "
        "(max); auto: the task metric's direction, min for any other (as Lightning's "
        "EarlyStopping).",
    )
    force: Annotated[bool, Role.OPERATIONAL] = Field(
        False,
        title="Force training",
        description="Train a new run even when a finished run of the same identity (data, "
        "model, training values) already has a registered version; otherwise that run and "
        "version are reused.",
    )

    @field_validator("workers", mode="before")
    @classmethod
    def _parse_workers(cls, workers: Any) -> Any:
        """``"4"``, ``"2-4"`` (a CLI flag) or ``[2, 4]`` (JSON) into an int or a (min, max)."""
        if isinstance(workers, str):
            low, _, high = workers.replace(":", "-").partition("-")
            try:
                return int(low) if not high else (int(low), int(high))
            except ValueError:
                raise ValueError(
                    f"{workers!r} is neither a worker count nor a range; write 4 or 2-4"
                ) from None
        return workers

    @field_validator("workers")
    @classmethod
    def _check_workers(cls, workers: int | tuple[int, int]) -> int | tuple[int, int]:
        low, high = (workers, workers) if isinstance(workers, int) else workers
        if low < 1 or high < low:
            raise ValueError(
                f"needs at least 1 worker, and a range needs max >= min (got {workers}); "
                "write e.g. 2 or 2-4"
            )
        return workers

    @model_validator(mode="after")
    def _check_training(self) -> TrainingParams:
        if self.precision == "fp16" and not self.use_gpu:
            raise ValueError("precision fp16 needs a GPU: set --use-gpu, or use --precision bf16")
        if self.accelerator_type and not self.use_gpu:
            raise ValueError("accelerator_type places GPU workers: set --use-gpu as well")
        self._check_mesh()
        if self.checkpoint_layout == "gathered" and self.strategy == "pp":
            raise ValueError(
                "checkpoint_layout gathered: no worker of a pipeline holds the whole model; "
                "use --checkpoint-layout sharded (or auto) with --strategy pp"
            )
        return self

    def _check_mesh(self) -> None:
        """Tensor- and pipeline-parallel sizes against the strategy and the worker count."""
        sizes = {"tp": "tensor_parallel_size", "pp": "pipeline_parallel_size"}
        for strategy, field in sizes.items():
            if getattr(self, field) and self.strategy != strategy:
                raise ValueError(f"{field} applies to --strategy {strategy}; unset it or use it")
        if self.strategy not in sizes:
            return
        if not isinstance(self.workers, int):
            raise ValueError(
                f"--strategy {self.strategy} needs a fixed worker count (its mesh is fixed), "
                f"not the range {self.workers[0]}-{self.workers[1]}"
            )
        field = sizes[self.strategy]
        size = getattr(self, field) or self.workers
        if size < 2 or self.workers % size:
            raise ValueError(
                f"{field} {size} must be at least 2 and divide the {self.workers} workers "
                f"(the rest of the mesh is data-parallel); use --workers {max(2, size)} or a "
                f"{field.replace('_', '-')} that divides --workers"
            )
        if self.strategy == "pp" and self.pipeline_microbatches > self.batch_size:
            raise ValueError(
                f"pipeline_microbatches {self.pipeline_microbatches} exceeds the batch size "
                f"{self.batch_size}: each microbatch needs a row; lower --pipeline-microbatches"
            )

    @property
    def early_stopping_monitor(self) -> str:
        """The metric early stopping watches: its own, else the best-checkpoint metric."""
        if self.early_stopping_metric is not None:
            return self.early_stopping_metric
        return "val_loss" if self.best_checkpoint_metric == "none" else self.best_checkpoint_metric

    def early_stopping(self) -> EarlyStopping | None:
        """Early stopping as these fields set it; None when it is off."""
        if not self.early_stopping_patience:
            return None
        return EarlyStopping.for_metric(
            self.early_stopping_monitor,
            self.early_stopping_patience,
            self.early_stopping_min_delta,
            self.early_stopping_direction,
        )

    @property
    def early_stopping_direction(self) -> Literal["auto", "min", "max"]:
        """The early-stopping mode, which follows the best-checkpoint metric's when it watches
        that metric."""
        if self.early_stopping_mode == "auto" and self.early_stopping_metric is None:
            return self.best_checkpoint_mode
        return self.early_stopping_mode

    def identity(self) -> dict[str, Any]:
        """The values that shape the result: every field but the operational ones, and early
        stopping's only when it is on (with patience 0 or unset the run is the one it was
        before those fields existed; min delta and metric then change nothing)."""
        roles = fields_with(TrainingParams, Role.OPERATIONAL, Role.EARLY_STOPPING)
        values = self.model_dump(mode="json", exclude=set(roles))
        if self.early_stopping_patience:
            values["early_stopping"] = {
                "patience": self.early_stopping_patience,
                "min_delta": self.early_stopping_min_delta,
                "metric": self.early_stopping_monitor,
            }
            if self.early_stopping_direction != "auto":  # runs from before the field: auto
                values["early_stopping"]["mode"] = self.early_stopping_direction
        return values

    @property
    def worker_range(self) -> tuple[int, int]:
        """(min, max) workers; equal for a fixed count."""
        if isinstance(self.workers, int):
            return self.workers, self.workers
        return self.workers
