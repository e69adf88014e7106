"""Flow parameters as pydantic models: Prefect validates them and renders them as UI forms.

Every check that needs no I/O happens here, when parameters are parsed; checks that need to
look at the data (label column, split sizes) happen in ``inspect_data`` before anything is
written. Field names are unique across sections because CLI flags mirror them.
"""

from __future__ import annotations

import difflib
import hashlib
import json
from collections.abc import Mapping
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import to_jsonable_python

from prefect_ml.integrations import problems, storage, tracking
from prefect_ml.integrations.canary import CanaryPolicy
from prefect_ml.integrations.catalog import resolve_dataset, resolve_model
from prefect_ml.integrations.errors import ConfigurationError
from prefect_ml.integrations.resources import (
    GB,
    RequestFields,
    ResourceRequest,
    custom_resources,
)


def _factory_defaults(schema: dict[str, Any], model: type[BaseModel]) -> None:
    """Write ``default_factory`` values into the JSON schema, so UI forms start from them."""
    properties = schema.get("properties", {})
    for name, field in model.model_fields.items():
        if field.default_factory is not None and name in properties:
            default = field.default_factory()  # type: ignore[call-arg]
            properties[name]["default"] = to_jsonable_python(default)


class _Section(BaseModel):
    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, json_schema_extra=_factory_defaults
    )


def _accelerator_field(title: str, placed: str, gpus_field: str) -> Any:
    return Field(
        None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        title=title,
        description=f"Place {placed} only on nodes with this accelerator (Ray's "
        f"accelerator_type, e.g. H100, A10G, L4); needs {gpus_field}.",
    )


def _resources_field(title: str, placed: str) -> Any:
    return Field(
        default_factory=dict,
        title=title,
        description=f"Custom Ray resources each of the {placed} reserves, e.g. "
        '{"fast_disk": 1}: they land only on nodes started with them (ray start --resources).',
    )


def _check_custom(resources: dict[str, float]) -> dict[str, float]:
    custom_resources(resources)
    return resources


# A mapping of custom Ray resources, each a name nodes declare and a positive amount.
CustomResources = Annotated[dict[str, float], AfterValidator(_check_custom)]


def _memory_field(title: str, reserved_for: str) -> Any:
    return Field(
        None, gt=0, title=title, description=f"Heap memory Ray reserves for {reserved_for}."
    )


class DataParams(_Section):
    """Which data to use and how to split and normalise it."""

    dataset: str = Field(
        "digits",
        title="Dataset",
        description="Built-in dataset ('digits', 'tabular'), a plug-in (entry point in "
        "'prefect_ml.datasets') or an import path 'package.module:loader' returning "
        "(features, labels), from a module under PREFECT_ML_ALLOWED_MODULES.",
    )
    url: str | None = Field(
        None,
        title="Data URL",
        description="For 'tabular': URL of a CSV or Parquet file, of a directory of them or a "
        "glob (a path, file://, s3://, gs://, abfs://; other schemes only if "
        "PREFECT_ML_EXTRA_URL_SCHEMES allows them). Big datasets are streamed (see "
        "PREFECT_ML_DATA_LAYOUT).",
    )
    task: problems.TaskType = Field(
        "classification",
        title="Task type",
        description="classification: labels are classes (cross-entropy; accuracy, macro-F1); "
        "regression: labels are numbers (mean squared error; RMSE, MAE, R²).",
    )
    label_column: str | None = Field(
        None,
        title="Label column",
        description="For 'tabular': the column holding the label (a class, or the regression "
        "target).",
    )
    dataset_options: dict[str, Any] = Field(
        default_factory=dict,
        title="Dataset options",
        description="Keyword arguments passed to a user dataset loader.",
    )
    val_fraction: float = Field(
        0.15, gt=0, lt=0.5, title="Validation fraction", description="Share of rows for validation."
    )
    test_fraction: float = Field(
        0.15, gt=0, lt=0.5, title="Test fraction", description="Share of rows held out for testing."
    )
    split_seed: int = Field(
        0,
        title="Split seed",
        description="Seed of the split (stratified by class for classification, random for "
        "regression).",
    )
    normalize: bool = Field(
        True,
        title="Normalise",
        description="Standardise features with mean and std fitted on the training split only.",
    )
    standardize_target: bool = Field(
        True,
        title="Standardise the target",
        description="Regression: train on the target standardised by the training split's mean "
        "and std; metrics and predictions stay in the target's units.",
    )

    @field_validator("url")
    @classmethod
    def _check_url(cls, url: str | None) -> str | None:
        return None if url is None else storage.check_data_url(url, "data.url")

    def loader_options(self) -> dict[str, Any]:
        if self.dataset == "tabular":
            return {"url": self.url, "label_column": self.label_column}
        return dict(self.dataset_options)

    @model_validator(mode="after")
    def _check_dataset(self) -> DataParams:
        if self.dataset == "tabular":
            for name in ("url", "label_column"):
                if not getattr(self, name):
                    flag = "--" + name.replace("_", "-")
                    raise ValueError(f"the 'tabular' dataset needs {name}; set {flag}")
        resolve_dataset(self.dataset, self.loader_options())
        if self.val_fraction + self.test_fraction >= 0.8:
            raise ValueError("val_fraction + test_fraction must leave at least 20% for training")
        return self


class ModelParams(_Section):
    """Which network to train and its shape."""

    model: str = Field(
        "mlp",
        title="Model",
        description="Built-in model ('mlp', 'cnn'), a plug-in (entry point in "
        "'prefect_ml.models') or an import path 'package.module:factory' called as "
        "factory(input_shape, num_classes, **options), from a module under "
        "PREFECT_ML_ALLOWED_MODULES.",
    )
    hidden: int = Field(128, ge=1, title="Hidden units", description="MLP: units per hidden layer.")
    depth: int = Field(2, ge=1, title="Depth", description="MLP: number of hidden layers.")
    channels: int = Field(
        32, ge=1, title="Channels", description="CNN: channels of the first conv."
    )
    dropout: float = Field(0.1, ge=0, lt=1, title="Dropout", description="Dropout probability.")
    model_options: dict[str, Any] = Field(
        default_factory=dict,
        title="Model options",
        description="Extra keyword arguments for a user model factory.",
    )

    @model_validator(mode="after")
    def _check_model(self) -> ModelParams:
        resolve_model(self.model, list(self.model_options))
        return self

    def factory_options(self) -> dict[str, Any]:
        """Options offered to the factory; it receives those its signature accepts."""
        built_in = {"hidden": self.hidden, "depth": self.depth, "channels": self.channels}
        return {**built_in, "dropout": self.dropout, **self.model_options}


# Training fields that change how a run is executed or stored, not what it computes: changing
# them resumes the same run, and a campaign cannot tune them.
# Workers and strategy are here because checkpoints restore under any layout: a run resumed on
# more or fewer workers, or sharded differently, is the same run.
OPERATIONAL_FIELDS = {
    "max_failures",
    "cpus_per_worker",
    "keep_checkpoints",
    "best_checkpoint_metric",
    "workers",
    "use_gpu",
    "accelerator_type",
    "allow_mixed_gpu_types",
    "memory_per_worker_gb",
    "worker_resources",
    "strategy",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "pipeline_microbatches",
    "pipeline_schedule",
    "checkpoint_layout",
    "checkpoint_every_steps",
    "checkpoint_every_seconds",
    "checkpoint_budget",
    "gradient_checkpointing",
    "collective_timeout_s",
    "elastic_resize_s",
    "force",  # whether a finished, registered run of this identity is reused, not what it is
}
# Early stopping shapes the result (which epochs train, which one is registered), so it is part
# of the identity, but only when it is on: with patience 0 or unset the run is the one it was
# before these fields existed, and min delta and metric change nothing (TrainingParams.identity).
EARLY_STOPPING_FIELDS = {
    "early_stopping_patience",
    "early_stopping_min_delta",
    "early_stopping_metric",
}


class TrainingParams(_Section):
    """How to train: workers, epochs, optimiser, fault tolerance."""

    workers: int | tuple[int, int] = Field(
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
    max_failures: int = Field(
        3,
        ge=0,
        title="Max failures",
        description="Worker failures tolerated; each restarts from the last checkpoint.",
    )
    use_gpu: bool = Field(
        False, title="Use GPU", description="One GPU per worker, NCCL instead of gloo."
    )
    cpus_per_worker: float = Field(
        1.0, gt=0, title="CPUs per worker", description="CPUs Ray reserves for each worker."
    )
    accelerator_type: str | None = _accelerator_field("GPU type", "workers", "use_gpu")
    allow_mixed_gpu_types: bool = Field(
        False,
        title="Allow mixed GPU types",
        description="Let one worker group span GPUs of different types (it then runs at the "
        "slowest GPU's pace); otherwise such a cluster needs --accelerator-type.",
    )
    memory_per_worker_gb: float | None = _memory_field("Memory per worker (GB)", "each worker")
    worker_resources: CustomResources = _resources_field("Custom resources per worker", "workers")
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32",
        title="Precision",
        description="Autocast precision: bf16 works on CPU and recent GPUs; fp16 needs a GPU and "
        "adds a gradient scaler.",
    )
    gradient_checkpointing: bool = Field(
        False,
        title="Gradient checkpointing",
        description="Recompute activations in backward instead of keeping them: less memory, "
        "about one more forward per step.",
    )
    strategy: Literal["ddp", "fsdp", "tp", "pp"] = Field(
        "ddp",
        title="Parallel strategy",
        description="ddp replicates the model on every worker; fsdp shards parameters, gradients "
        "and optimiser state across workers (FSDP2); tp splits each layer's weights across the "
        "workers of a tensor-parallel group (DTensor); pp puts consecutive layers on the "
        "stages of a pipeline (torch.distributed.pipelining).",
    )
    tensor_parallel_size: int = Field(
        0,
        ge=0,
        title="Tensor-parallel size",
        description="--strategy tp: workers per tensor-parallel group (0: all workers). Fewer "
        "than the workers makes a 2-D mesh: the groups train data-parallel with FSDP.",
    )
    pipeline_parallel_size: int = Field(
        0,
        ge=0,
        title="Pipeline stages",
        description="--strategy pp: stages per pipeline, one worker each (0: all workers). "
        "Fewer than the workers makes a 2-D mesh: the pipelines train data-parallel.",
    )
    pipeline_microbatches: int = Field(
        4,
        ge=1,
        title="Pipeline microbatches",
        description="--strategy pp: microbatches each batch is split into; at most the batch size.",
    )
    pipeline_schedule: Literal["1f1b", "gpipe"] = Field(
        "1f1b",
        title="Pipeline schedule",
        description="--strategy pp: 1f1b (one forward, one backward: activations of at most "
        "the stage count in flight) or gpipe (all forwards, then all backwards).",
    )
    checkpoint_layout: Literal["auto", "gathered", "sharded"] = Field(
        "auto",
        title="Checkpoint layout",
        description="gathered: rank 0 gathers the whole state and writes it; sharded: every "
        "worker writes its own shards, committed by one manifest once all are verified. auto: "
        "sharded for fsdp, tp and pp, gathered for ddp.",
    )
    checkpoint_every_steps: int = Field(
        0,
        ge=0,
        title="Checkpoint every N steps",
        description="Also commit a checkpoint every N training steps inside an epoch (0: at "
        "epoch ends only); a resumed run restarts at the step after it, in the same data order.",
    )
    checkpoint_every_seconds: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        title="Checkpoint every N seconds",
        description="Also commit a checkpoint once this many seconds have passed since the last "
        "one, at the next step (0: off).",
    )
    checkpoint_budget: float = Field(
        0.05,
        ge=0,
        le=1,
        allow_inf_nan=False,
        title="Checkpoint budget",
        description="Most of the training time that checkpoints may block it for (0.05: 5%): an "
        "epoch commits its weights only while that holds (a worker group's first and the last "
        "always); "
        "the others commit their metrics only (all reach MLflow) and a resumed run replays "
        "them from the last epoch with weights. The best epoch's weights are kept. 0: every "
        "epoch commits its weights.",
    )
    collective_timeout_s: int = Field(
        1800,
        ge=10,
        title="Collective timeout (s)",
        description="How long a collective waits for a lost or hung worker before the group fails "
        "and restarts from the last checkpoint.",
    )
    elastic_resize_s: float = Field(
        60.0,
        gt=0,
        title="Elastic resize check (s)",
        description="Elastic runs ('min-max' workers): how often a healthy group below max looks "
        "for room to grow (Ray Train's elastic_resize_monitor_interval_s); growing restarts the "
        "group from the last checkpoint.",
    )
    keep_checkpoints: int = Field(
        3,
        ge=1,
        title="Checkpoints kept",
        description="Newest checkpoints that keep their weights; older ones keep only their "
        "metrics (the best one by the best-checkpoint metric is kept too).",
    )
    best_checkpoint_metric: Literal[
        "val_loss", "val_accuracy", "val_rmse", "val_mae", "val_r2", "none"
    ] = Field(
        "val_loss",
        title="Best-checkpoint metric",
        description="Validation metric whose best epoch keeps its weights whatever its age "
        "(one the task type produces); 'none' keeps only the newest.",
    )
    early_stopping_patience: int | None = Field(
        None,
        ge=0,
        title="Early-stopping patience",
        description="Stop once the early-stopping metric has not improved by the min delta for "
        "this many epochs; the best epoch's weights are then evaluated and registered. 0 or "
        "unset: train every epoch.",
    )
    early_stopping_min_delta: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        title="Early-stopping min delta",
        description="How much an epoch must beat the best value so far to count as improving.",
    )
    early_stopping_metric: (
        Literal["val_loss", "val_accuracy", "val_rmse", "val_mae", "val_r2"] | None
    ) = Field(
        None,
        title="Early-stopping metric",
        description="Validation metric early stopping watches (one the task type produces); by "
        "default the best-checkpoint metric (val_loss when that is 'none').",
    )
    force: bool = Field(
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

    def identity(self) -> dict[str, Any]:
        """The values that shape the result (see OPERATIONAL_FIELDS, EARLY_STOPPING_FIELDS)."""
        values = self.model_dump(mode="json", exclude=OPERATIONAL_FIELDS | EARLY_STOPPING_FIELDS)
        if self.early_stopping_patience:
            values["early_stopping"] = {
                "patience": self.early_stopping_patience,
                "min_delta": self.early_stopping_min_delta,
                "metric": self.early_stopping_monitor,
            }
        return values

    @property
    def worker_range(self) -> tuple[int, int]:
        """(min, max) workers; equal for a fixed count."""
        if isinstance(self.workers, int):
            return self.workers, self.workers
        return self.workers

    def worker_request(self) -> ResourceRequest:
        """What Ray reserves for each training worker."""
        return ResourceRequest(
            cpus=self.cpus_per_worker,
            gpus=1.0 if self.use_gpu else 0.0,
            accelerator_type=self.accelerator_type,
            memory_bytes=_bytes(self.memory_per_worker_gb),
            custom=custom_resources(self.worker_resources),
        )


class RegistryParams(_Section):
    """Where the model is registered and when it is promoted."""

    model_name: str = Field(
        "digits-classifier",
        min_length=1,
        title="Registered model name",
        description="Name of the model in the MLflow registry.",
    )
    metric: Literal["accuracy", "macro_f1", "loss", "rmse", "mae", "r2"] | None = Field(
        None,
        title="Promotion metric",
        description="Test metric compared with the champion (one the task type produces); by "
        "default accuracy for classification, rmse for regression.",
    )
    direction: Literal["maximize", "minimize"] | None = Field(
        None,
        title="Direction",
        description="Whether a higher or lower metric is better; by default the metric's own "
        "(loss, rmse and mae are minimised, the others maximised).",
    )
    min_delta: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        title="Minimum improvement",
        description="How much better than the champion a new version must be to take the alias.",
    )
    alias: str = Field(
        "champion", min_length=1, title="Alias", description="Alias given to the best version."
    )

    def promotion(self, problem: problems.Problem) -> dict[str, dict[str, Any]]:
        """The ``promote_if`` and ``directions`` options of the registry step for ``problem``."""
        metric = self.metric or problem.promotion
        directions = {metric: self.direction} if self.direction else {}
        return {"promote_if": {metric: self.min_delta}, "directions": directions}


class TrainingSections(_Section):
    """What every training flow takes: the experiment and the data, model and training sections."""

    experiment: str = Field(
        "prefect-ml",
        min_length=1,
        max_length=200,
        title="Experiment",
        description="MLflow experiment name; its artifacts live under the artifact root in a "
        "folder of this name, so it may not contain '..' segments or start with '/'.",
    )
    data: DataParams = Field(
        default_factory=DataParams,
        title="Data",
        description="Which dataset, and how it is split and normalised.",
    )
    model: ModelParams = Field(
        default_factory=ModelParams, title="Model", description="The network and its shape."
    )
    training: TrainingParams = Field(
        default_factory=TrainingParams,
        title="Training",
        description="Workers, epochs, optimiser and fault tolerance.",
    )

    @field_validator("experiment")
    @classmethod
    def _check_experiment(cls, experiment: str) -> str:
        return tracking.check_experiment_name(experiment)

    @model_validator(mode="after")
    def _check_task_metrics(self) -> TrainingSections:
        """Every metric a section names is one the data's task type produces; a campaign that
        names no objective optimises the task's headline metric."""
        problem = problems.problem(self.data.task)
        named: list[tuple[str, str]] = [
            ("training.best_checkpoint_metric", self.training.best_checkpoint_metric)
        ]
        if self.training.early_stopping_metric is not None:
            named.append(("training.early_stopping_metric", self.training.early_stopping_metric))
        registry: RegistryParams | None = getattr(self, "registry", None)
        if registry is not None and registry.metric is not None:
            named.append(("registry.metric", registry.metric))
        for field, metric in named:
            known = problem.test_metrics if field == "registry.metric" else problem.epoch_metrics
            if metric != "none" and metric not in known:
                raise ValueError(
                    f"{field}: {problem.name} produces no {metric!r}; use one of {list(known)} "
                    "(or set --task)"
                )
        sweep: SweepParams | None = getattr(self, "sweep", None)
        if sweep is not None:
            if "objectives" not in sweep.model_fields_set:
                headline = {problem.headline: problem.epoch_metrics[problem.headline]}
                sweep.objectives = headline  # type: ignore[assignment]
            unknown = [name for name in sweep.objectives if name not in problem.epoch_metrics]
            if unknown:
                raise ValueError(
                    f"sweep.objectives: {problem.name} produces no {unknown}; choose from "
                    f"{list(problem.epoch_metrics)}"
                )
        return self

    def run_key(self, fingerprint: str) -> str:
        """Identity of a training run: the same command on the same data resumes the same run."""
        identity = {
            "experiment": self.experiment,
            "fingerprint": fingerprint,
            "model": self.model.model_dump(mode="json"),
            "training": self.training.identity(),
        }
        return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


class TrainModelParams(TrainingSections):
    """Parameters of ``train_model``: data, model, training and registry sections."""

    registry: RegistryParams = Field(
        default_factory=RegistryParams,
        title="Registry",
        description="Where the model is registered and when it takes the alias.",
    )


# Search-space names a campaign may tune: every model and training field that shapes the result.
SEARCHABLE_SECTIONS: dict[str, type[_Section]] = {"model": ModelParams, "training": TrainingParams}
# Early stopping is not searched: a campaign's trials train every epoch, its pruner stops them.
NOT_SEARCHABLE = {
    "model",
    "model_options",
    "workers",
    "use_gpu",
    *OPERATIONAL_FIELDS,
    *EARLY_STOPPING_FIELDS,
}
EPOCH_METRICS = tuple(problems.EPOCH_METRICS)  # of every task type; each flow checks its own


# Grid search: values per dimension and trials in the whole grid, checked before any is built
# (Optuna's GridSampler holds every combination in memory).
MAX_GRID_POINTS = 10_000
MAX_GRID_TRIALS = 100_000


class SearchDimension(_Section):
    """One tuned parameter: a float or int range, or a list of choices."""

    type: Literal["float", "int", "categorical"] = Field(
        title="Type", description="'float' and 'int' are ranges [low, high]; 'categorical' picks."
    )
    low: float | None = Field(None, title="Low", description="Lower bound (float and int).")
    high: float | None = Field(None, title="High", description="Upper bound (float and int).")
    log: bool = Field(False, title="Log scale", description="Sample on a log scale (low > 0).")
    step: float | None = Field(
        None, gt=0, title="Step", description="Grid step (int and float; required by 'grid')."
    )
    choices: list[str | int | float | bool] | None = Field(
        None, title="Choices", description="Values of a 'categorical' dimension."
    )

    @model_validator(mode="after")
    def _check_dimension(self) -> SearchDimension:
        if self.type == "categorical":
            if not self.choices:
                raise ValueError("choices must be a non-empty list for a 'categorical' dimension")
            return self
        if self.low is None or self.high is None:
            raise ValueError(f"a '{self.type}' dimension needs both low and high")
        if not self.low < self.high:
            raise ValueError(f"low ({self.low:g}) must be smaller than high ({self.high:g})")
        if self.log and self.low <= 0:
            raise ValueError(f"log scale needs low > 0 (got low={self.low:g})")
        if self.log and self.step is not None:
            raise ValueError("log and step cannot be combined")
        return self

    def candidate_values(self) -> list[Any]:
        """Values that must all be valid training parameters: the bounds or every choice."""
        if self.type == "categorical":
            return list(self.choices or [])
        assert self.low is not None and self.high is not None  # checked by the validator
        if self.type == "int":
            return [int(self.low), int(self.high)]
        return [self.low, self.high]

    def grid_size(self) -> int:
        """How many values a grid search visits, counted without building them."""
        if self.type == "categorical":
            return len(self.choices or [])
        assert self.low is not None and self.high is not None
        if self.step is None and self.type == "float":
            raise ValueError("a float dimension needs a step for grid search")
        step = self.step or 1
        if self.type == "int" and step != int(step):
            raise ValueError(f"an int dimension's step must be a whole number (got {step:g})")
        span = (self.high - self.low) / step  # inf for a range beyond float's: capped below
        return int(min(span, float(2**62)) + 1e-9) + 1

    def grid(self) -> list[Any]:
        """Every value a grid search visits (at most :data:`MAX_GRID_POINTS`)."""
        size = self.grid_size()
        if size > MAX_GRID_POINTS:
            raise ValueError(
                f"the grid has {size:,} values, more than {MAX_GRID_POINTS:,}; raise its step or "
                "narrow low and high"
            )
        if self.type == "categorical":
            return list(self.choices or [])
        assert self.low is not None and self.high is not None
        if self.type == "int":
            return list(range(int(self.low), int(self.high) + 1, int(self.step or 1)))
        assert self.step is not None
        return [self.low + i * self.step for i in range(size)]


def default_search_space() -> dict[str, SearchDimension]:
    return {
        "lr": SearchDimension(type="float", low=1e-4, high=1e-1, log=True),
        "hidden": SearchDimension(type="int", low=32, high=256),
        "dropout": SearchDimension(type="float", low=0.0, high=0.5),
        "optimizer": SearchDimension(type="categorical", choices=["adam", "sgd"]),
    }


class SweepParams(_Section):
    """The campaign: what to search, how to choose, how much to spend and how wide to run."""

    campaign: str = Field(
        "default",
        min_length=1,
        max_length=100,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
        title="Campaign name",
        description="Names the Optuna study; running the same name again continues it.",
    )
    search_space: dict[str, SearchDimension] = Field(
        default_factory=default_search_space,
        title="Search space",
        description='Tuned parameters, e.g. {"lr": {"type": "float", "low": 1e-4, "high": 0.1, '
        '"log": true}}; names are model or training parameters.',
    )
    objectives: dict[str, Literal["maximize", "minimize"]] = Field(
        default_factory=lambda: {"val_accuracy": "maximize"},  # type: ignore[arg-type,return-value]
        title="Objectives",
        description="Validation metric(s) of the last epoch and their direction "
        f"({', '.join(EPOCH_METRICS)}); several give a Pareto front.",
    )
    sampler: Literal["tpe", "random", "cmaes", "grid"] = Field(
        "tpe", title="Sampler", description="How Optuna proposes the next trial."
    )
    sampler_seed: int | None = Field(0, title="Sampler seed", description="Seed of the sampler.")
    pruner: Literal["median", "hyperband", "successive_halving", "none"] = Field(
        "median",
        title="Pruner",
        description="Stops unpromising trials early (single objective only).",
    )
    n_trials: int | None = Field(
        20, ge=1, title="Trials", description="Trials to finish (completed, pruned or failed)."
    )
    timeout_seconds: float | None = Field(
        None, gt=0, title="Timeout (s)", description="Stop starting new trials after this long."
    )
    concurrency: int = Field(2, ge=1, title="Concurrency", description="Trials run in parallel.")
    trial_cpus: float = Field(1.0, gt=0, title="CPUs per trial", description="CPUs per trial.")
    trial_gpus: float = Field(
        0.0, ge=0, title="GPUs per trial", description="GPUs per trial (per worker with >1)."
    )
    trial_accelerator_type: str | None = _accelerator_field(
        "GPU type per trial", "trials", "trial_gpus"
    )
    trial_memory_gb: float | None = _memory_field(
        "Memory per trial (GB)", "each trial (each worker with >1)"
    )
    trial_resources: CustomResources = _resources_field("Custom resources per trial", "trials")
    trial_workers: int = Field(
        1,
        ge=1,
        title="Workers per trial",
        description="1: a trial trains in one warm process; >1: each trial is a Ray Train run.",
    )
    max_consecutive_failures: int = Field(
        10,
        ge=1,
        title="Failures in a row",
        description="Stop the campaign after this many trials in a row failed.",
    )
    stop_at: float | None = Field(
        None,
        allow_inf_nan=False,
        title="Stop at value",
        description="Start no more trials once an epoch reaches this value of the first "
        "objective (e.g. 0.97 val_accuracy); running trials finish.",
    )

    @model_validator(mode="after")
    def _check_sweep(self) -> SweepParams:
        if self.n_trials is None and self.timeout_seconds is None:
            raise ValueError("set a budget: n_trials and/or timeout_seconds")
        if not self.search_space:
            raise ValueError("search_space is empty; name at least one parameter to tune")
        if not self.objectives:
            raise ValueError("objectives is empty; e.g. {'val_accuracy': 'maximize'}")
        unknown = [name for name in self.objectives if name not in EPOCH_METRICS]
        if unknown:
            raise ValueError(f"unknown objective {unknown}; choose from {list(EPOCH_METRICS)}")
        if len(self.objectives) > 1 and "pruner" in self.model_fields_set and self.pruner != "none":
            raise ValueError("pruning needs a single objective; set --pruner none")
        if self.trial_accelerator_type and not self.trial_gpus:
            raise ValueError("trial_accelerator_type places GPU trials: set --trial-gpus as well")
        trials = 1
        for name, dimension in self.search_space.items():
            _check_searchable(name, dimension)
            if self.sampler == "grid":
                try:
                    trials *= len(dimension.grid())
                except ValueError as exc:
                    raise ValueError(f"search_space.{name}: {exc}") from exc
        if trials > MAX_GRID_TRIALS:
            sizes = {name: d.grid_size() for name, d in self.search_space.items()}
            raise ValueError(
                f"search_space: the grid has {trials:,} combinations {sizes}, more than "
                f"{MAX_GRID_TRIALS:,}; coarsen the largest dimension"
            )
        return self

    @property
    def effective_pruner(self) -> str:
        return self.pruner if len(self.objectives) == 1 else "none"

    def trial_request(self) -> ResourceRequest:
        """What one trial process (or, with several workers, each of its workers) reserves."""
        return ResourceRequest(
            cpus=self.trial_cpus,
            gpus=self.trial_gpus,
            accelerator_type=self.trial_accelerator_type,
            memory_bytes=_bytes(self.trial_memory_gb),
            custom=custom_resources(self.trial_resources),
        )


WORKER_FIELDS = RequestFields(
    count="training.workers",
    cpus="training.cpus_per_worker",
    gpus="training.use_gpu",
    accelerator_type="training.accelerator_type",
    memory="training.memory_per_worker_gb",
    custom="training.worker_resources",
)
TRIAL_FIELDS = RequestFields(
    count="sweep.trial_workers",
    cpus="sweep.trial_cpus",
    gpus="sweep.trial_gpus",
    accelerator_type="sweep.trial_accelerator_type",
    memory="sweep.trial_memory_gb",
    custom="sweep.trial_resources",
)


def _bytes(gigabytes: float | None) -> int | None:
    return None if gigabytes is None else int(gigabytes * GB)


def _check_searchable(name: str, dimension: SearchDimension) -> None:
    """``name`` is a tunable model or training field and every candidate value is valid for it."""
    section = next((s for s, m in SEARCHABLE_SECTIONS.items() if name in m.model_fields), None)
    if section is None or name in NOT_SEARCHABLE:
        tunable = sorted(
            n
            for m in SEARCHABLE_SECTIONS.values()
            for n in m.model_fields
            if n not in NOT_SEARCHABLE
        )
        raise ValueError(f"search_space: '{name}' is not a tunable parameter; use one of {tunable}")
    model = SEARCHABLE_SECTIONS[section]
    for value in dimension.candidate_values():
        try:
            model.model_validate({name: value})
        except ValidationError as exc:
            problem = exc.errors()[0]["msg"]
            raise ValueError(
                f"search_space.{name}: {value!r} is not a valid {name}: {problem}"
            ) from None


class CampaignParams(TrainingSections):
    """Parameters of ``hpo_campaign``: data, model and fixed training values, and the search."""

    sweep: SweepParams = Field(
        default_factory=SweepParams,
        title="Sweep",
        description="What to search, how to choose, the budget and the parallelism.",
    )


# Serving options that chose the bearer token; refused with what to set instead.
REMOVED_TOKEN_FIELDS = frozenset({"auth_token_env", "auth_token_secret"})


class ServingParams(_Section):
    """How the model is served: address, batching, replicas and their resources, request limits."""

    host: str = Field(
        "127.0.0.1",
        min_length=1,
        title="Host",
        description="Interface the HTTP proxy binds; any but loopback (0.0.0.0 exposes it) "
        "needs a bearer token, PREFECT_ML_SERVE_TOKEN or PREFECT_ML_SERVE_TOKEN_SECRET.",
    )
    port: int = Field(8000, ge=1, le=65535, title="Port", description="HTTP port.")
    app_name: str = Field(
        "prefect-ml",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
        title="Application name",
        description="Ray Serve application; deploying the same name again rolls it.",
    )
    route_prefix: str = Field(
        "/", pattern=r"^/", title="Route prefix", description="URL path the application serves."
    )
    batching: bool = Field(
        True,
        title="Adaptive batching",
        description="Requests that arrive while the model runs go through it together in the "
        "next call; a request that finds the model idle runs at once.",
    )
    max_batch_size: int = Field(
        32, ge=1, title="Max batch size", description="Requests merged into one model call."
    )
    batch_wait_timeout_s: float = Field(
        0.0,
        ge=0,
        le=1,
        title="Batch wait under load (s)",
        description="How long a batch that formed while the model was busy, but is not full, "
        "may wait for more requests (0: never; an idle model never waits).",
    )
    batch_inline_below_s: float = Field(
        0.002,
        ge=0,
        le=1,
        title="Run fast model calls inline (s)",
        description="While the model's last call took less than this, the next runs on the "
        "replica's event loop, without the hand-off to the batcher's thread and back (which "
        "costs more than a sub-millisecond call); slower models run in the thread, so requests "
        "keep being received meanwhile. 0: always in the thread.",
    )
    min_replicas: int = Field(1, ge=1, title="Min replicas", description="Replicas always up.")
    max_replicas: int = Field(
        1, ge=1, title="Max replicas", description="Upper bound for autoscaling (> min enables it)."
    )
    target_ongoing_requests: float = Field(
        8,
        gt=0,
        title="Target ongoing requests",
        description="Autoscaling target: in-flight requests per replica.",
    )
    max_ongoing_requests: int = Field(
        64, ge=1, title="Max ongoing requests", description="In-flight requests per replica."
    )
    max_queued_requests: int = Field(
        512,
        ge=-1,
        title="Max queued requests",
        description="Requests waiting for a replica beyond which new ones get a 503 with "
        "Retry-After (-1: no limit).",
    )
    retry_after_s: float = Field(
        1.0, ge=0, title="Retry-After (s)", description="Retry-After of an overload 503."
    )
    access_log: bool = Field(
        True,
        title="Access log",
        description="Each replica logs one line per request (Ray Serve's access log, in the "
        "replica's log and the driver's terminal); off: none. A request that raises is logged "
        "with its traceback either way.",
    )
    request_timeout_s: float = Field(
        30.0,
        gt=0,
        title="Request body timeout (s)",
        description="A request whose body has not all arrived by then gets a 408 (slow clients "
        "cannot hold a replica).",
    )
    deploy_timeout_s: float = Field(
        120.0,
        gt=0,
        title="Deploy timeout (s)",
        description="Every replica must have loaded the model by then, or the deployment fails "
        "with the replica's error (a new application is removed; a roll keeps the old version).",
    )
    replica_cpus: float = Field(1.0, gt=0, title="CPUs per replica", description="CPUs reserved.")
    replica_gpus: float = Field(
        0.0, ge=0, title="GPUs per replica", description="GPUs reserved; fractions share a GPU."
    )
    replica_accelerator_type: str | None = _accelerator_field(
        "GPU type per replica", "replicas", "replica_gpus"
    )
    inference_precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32",
        title="Inference precision",
        description="Autocast dtype of the forward pass on a GPU replica (bf16/fp16 need "
        "--replica-gpus); probabilities are returned as float32 either way.",
    )
    replica_memory_gb: float | None = _memory_field("Memory per replica (GB)", "each replica")
    replica_resources: CustomResources = _resources_field(
        "Custom resources per replica", "replicas"
    )
    max_rows: int = Field(
        1024, ge=1, title="Max rows per request", description="Larger batches get a 413."
    )
    max_body_bytes: int = Field(
        4 * 1024 * 1024,
        ge=1024,
        title="Max body (bytes)",
        description="Larger request bodies get a 413.",
    )
    smoke_test: bool = Field(
        True, title="Smoke request", description="Send one example request after deploying."
    )
    canary_share: float = Field(
        0.0,
        ge=0,
        lt=1,
        title="Canary share",
        description="When the application already serves another version of the model: the "
        "share of requests the new one answers while both are compared, before it takes them "
        "all or is rolled back (0: roll straight to 100%).",
    )
    canary_window_s: float = Field(
        300.0,
        gt=0,
        title="Canary window (s)",
        description="How long the canary is compared with the serving version (errors end it "
        "early).",
    )
    canary_min_requests: int = Field(
        20,
        ge=1,
        title="Canary min requests",
        description="Requests the canary must answer in the window to be judged; fewer roll it "
        "back.",
    )
    canary_max_error_increase: float = Field(
        0.01,
        ge=0,
        le=1,
        title="Canary max error increase",
        description="How much higher than the serving version's the canary's error rate may be "
        "(0.01: one point).",
    )
    canary_max_latency_ratio: float = Field(
        1.5,
        ge=1,
        title="Canary max latency ratio",
        description="How many times the serving version's p95 latency the canary's may be.",
    )
    canary_max_metric_drop: float = Field(
        0.02,
        ge=0,
        title="Canary max metric drop",
        description="On requests that carry labels: how much worse the canary's accuracy (or "
        "RMSE) may be.",
    )

    @field_validator("route_prefix")
    @classmethod
    def _check_route_prefix(cls, route_prefix: str) -> str:
        """No ``..`` or ``.`` segment (percent-encoded too) nor backslash: a tenant's route
        ``/<tenant><route>`` must stay under its tenant however a client resolves it."""
        try:
            storage.check_key(route_prefix.lstrip("/"))
        except ConfigurationError as exc:
            raise ValueError(f"{exc.message}; give a plain path such as /models") from None
        return route_prefix

    @model_validator(mode="before")
    @classmethod
    def _refuse_token_parameters(cls, values: Any) -> Any:
        """The token and the variable or block it comes from are the operator's: a parameter
        that picked them could send any secret of the environment to a host it picks."""
        removed = sorted(set(values) & REMOVED_TOKEN_FIELDS) if isinstance(values, dict) else []
        if removed:
            raise ValueError(
                f"serving.{removed[0]} is no longer a parameter: the bearer token comes from "
                "the settings of the process that serves, PREFECT_ML_SERVE_TOKEN or "
                "PREFECT_ML_SERVE_TOKEN_SECRET (a Prefect Secret block's name); drop the option"
            )
        return values

    @model_validator(mode="after")
    def _check_serving(self) -> ServingParams:
        if self.max_replicas < self.min_replicas:
            raise ValueError(
                f"max_replicas ({self.max_replicas}) is below min_replicas ({self.min_replicas}); "
                "raise --max-replicas"
            )
        if self.batching and self.max_ongoing_requests < self.max_batch_size:
            raise ValueError(
                f"max_ongoing_requests ({self.max_ongoing_requests}) is below max_batch_size "
                f"({self.max_batch_size}), so batches could never fill; raise "
                "--max-ongoing-requests or lower --max-batch-size"
            )
        if self.replica_accelerator_type and not self.replica_gpus:
            raise ValueError(
                "replica_accelerator_type places GPU replicas: set --replica-gpus as well"
            )
        if self.inference_precision != "fp32" and not self.replica_gpus:
            raise ValueError(
                f"inference_precision {self.inference_precision} needs a GPU replica: set "
                "--replica-gpus, or keep --inference-precision fp32"
            )
        return self

    def canary_policy(self) -> CanaryPolicy | None:
        """How a new version is compared with the serving one, or None to roll straight."""
        if not self.canary_share:
            return None
        return CanaryPolicy(
            share=self.canary_share,
            window_s=self.canary_window_s,
            min_requests=self.canary_min_requests,
            max_error_increase=self.canary_max_error_increase,
            max_latency_ratio=self.canary_max_latency_ratio,
            max_metric_drop=self.canary_max_metric_drop,
        )

    def replica_request(self) -> ResourceRequest:
        """What one serving replica reserves."""
        return ResourceRequest(
            cpus=self.replica_cpus,
            gpus=self.replica_gpus,
            accelerator_type=self.replica_accelerator_type,
            memory_bytes=_bytes(self.replica_memory_gb),
            custom=custom_resources(self.replica_resources),
        )

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}{self.route_prefix.rstrip('/')}"


REPLICA_FIELDS = RequestFields(
    count="serving.min_replicas",
    cpus="serving.replica_cpus",
    gpus="serving.replica_gpus",
    accelerator_type="serving.replica_accelerator_type",
    memory="serving.replica_memory_gb",
    custom="serving.replica_resources",
)


class ServeModelParams(_Section):
    """Parameters of ``serve_model``: which registered version, and how to serve it."""

    model_name: str = Field(
        "digits-classifier",
        min_length=1,
        title="Registered model name",
        description="Name of the model in the MLflow registry.",
    )
    alias: str = Field(
        "champion", min_length=1, title="Alias", description="Serve the version holding this alias."
    )
    model_version: str | None = Field(
        None,
        pattern=r"^[0-9]+$",
        title="Version",
        description="Serve this version number instead of the alias.",
    )
    serving: ServingParams = Field(
        default_factory=ServingParams,
        title="Serving",
        description="Address, batching, replicas and their resources, request limits.",
    )


class PredictParams(_Section):
    """Parameters of ``batch_predict``: which registered version scores which files, where the
    predictions go, and how the scoring actors run."""

    model_name: str = Field(
        "digits-classifier",
        min_length=1,
        title="Registered model name",
        description="Name of the model in the MLflow registry.",
    )
    alias: str = Field(
        "champion",
        min_length=1,
        title="Alias",
        description="Score with the version holding this alias.",
    )
    model_version: str | None = Field(
        None,
        pattern=r"^[0-9]+$",
        title="Version",
        description="Score with this version number instead of the alias.",
    )
    url: str | None = Field(
        None,
        title="Data URL",
        description="Required: the rows to score, raw features as /predict takes them: a CSV or "
        "Parquet file, a directory of them or a glob (a path, file://, s3://, ...). Columns the "
        "model does not take pass through to the output.",
    )
    output: str | None = Field(
        None,
        title="Output URL",
        description="Folder for the predictions (Parquet and a _SUCCESS manifest) [default: "
        "<storage>/predictions/<fingerprint of the files and the version>].",
    )
    force: bool = Field(
        False,
        title="Score again",
        description="Score even when the output already holds this input's predictions by this "
        "version.",
    )
    batch_size: int = Field(
        8192, ge=1, title="Batch size", description="Rows per model call in each actor."
    )
    concurrency: int = Field(
        2, ge=1, title="Actors", description="Scoring actors, each loading the model once."
    )
    cpus_per_actor: float = Field(
        0.5,
        gt=0,
        title="CPUs per actor",
        description="CPUs each actor reserves; its torch threads: the whole CPUs, at least 1. "
        "Leave room for the reads (a quarter CPU each).",
    )
    use_gpu: bool = Field(
        False, title="Use GPUs", description="Give each actor a GPU and score on it."
    )
    inference_precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32",
        title="Inference precision",
        description="Autocast dtype on a GPU (bf16/fp16 need --use-gpu); probabilities are "
        "written as float32 either way.",
    )

    @field_validator("url")
    @classmethod
    def _check_url(cls, url: str | None) -> str | None:
        return None if url is None else storage.check_data_url(url, "url")

    @field_validator("output")
    @classmethod
    def _check_output(cls, output: str | None) -> str | None:
        return None if output is None else storage.check_data_url(output, "output")

    @model_validator(mode="after")
    def _check_predict(self) -> PredictParams:
        if self.inference_precision != "fp32" and not self.use_gpu:
            raise ValueError(
                f"inference_precision {self.inference_precision} needs a GPU: set --use-gpu, or "
                "keep --inference-precision fp32"
            )
        return self

    def required_url(self) -> str:
        """The data URL, or a ConfigurationError naming ``url`` when none was given."""
        if self.url is None:
            raise ConfigurationError("url", "give the rows to score: set --url")
        return self.url


class PipelineParams(TrainModelParams):
    """Parameters of ``ml_pipeline``: a training run, optionally preceded by a campaign."""

    sweep: SweepParams | None = Field(
        None,
        title="Sweep",
        description="When set, a campaign runs first; the model trains with its best values.",
    )
    serving: ServingParams | None = Field(
        None,
        title="Serving",
        description="When set, the pipeline ends by serving the alias's version on Ray Serve.",
    )

    def campaign(self) -> CampaignParams:
        if self.sweep is None:
            raise ValueError("this pipeline has no sweep section")
        return CampaignParams(
            experiment=self.experiment,
            data=self.data,
            model=self.model,
            training=self.training,
            sweep=self.sweep,
        )


Tunable = TypeVar("Tunable", bound=TrainingSections)


def with_trial_values(params: Tunable, values: dict[str, Any]) -> Tunable:
    """``params`` with tuned values put into their model and training sections (validated)."""
    updates: dict[str, dict[str, Any]] = {}
    for name, value in values.items():
        section = next(s for s, m in SEARCHABLE_SECTIONS.items() if name in m.model_fields)
        updates.setdefault(section, {})[name] = value
    merged = params.model_dump()
    for section, changes in updates.items():
        merged[section].update(changes)
    return type(params).model_validate(merged)


Params = TypeVar("Params", bound=BaseModel)


def section_options(*sections: BaseModel) -> dict[str, Any]:
    """The fields of ``sections`` set by whoever made them, as one flat dict of keyword options:
    what a flow passes to the public tasks. Unset fields keep their defaults there, and checks
    that look at what was set (a pruner named with several objectives) see the same."""
    return {k: v for section in sections for k, v in section.model_dump(exclude_unset=True).items()}


def params_from_options(
    params_type: type[Params], options: Mapping[str, Any], *, step: str, **fixed: Any
) -> Params:
    """``params_type`` from a public task's keyword ``options``, each a field of one of its
    sections (field names are unique across sections), plus the ``fixed`` top-level values.

    Raises:
        ConfigurationError: naming the option, for an unknown one (with the close matches and
            the full list) or an invalid value; nothing has run yet.
    """
    sections = {
        name: field.annotation
        for name, field in params_type.model_fields.items()
        if name not in fixed
        and isinstance(field.annotation, type)
        and issubclass(field.annotation, _Section)
    }
    # The section each option belongs to; None for a field of ``params_type`` itself.
    owner: dict[str, str | None] = {
        name: None
        for name in params_type.model_fields
        if name not in fixed and name not in sections
    }
    owner.update(
        {option: name for name, model in sections.items() for option in model.model_fields}
    )
    values: dict[str, Any] = {**fixed, **{name: {} for name in sections}}
    for option, value in options.items():
        if option not in owner:
            close = difflib.get_close_matches(option, owner, n=3)
            hint = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
            raise ConfigurationError(
                option, f"{step}() has no option {option!r}; {hint}its options are {sorted(owner)}"
            )
        section = owner[option]
        if section is None:
            values[option] = value
        else:
            values[section][option] = value
    try:
        return params_type.model_validate(values)
    except ValidationError as exc:
        error = exc.errors()[0]
        location = [str(part) for part in error["loc"]]
        # ("training", "epochs") is the option ``epochs``; a cross-field check names its section.
        field = location[1] if len(location) > 1 and location[0] in sections else ".".join(location)
        message = error["msg"].removeprefix("Value error, ")
        raise ConfigurationError(field or step, message) from None
