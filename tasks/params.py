"""Flow parameters as pydantic models: Prefect validates them and renders them as UI forms.

Every check that needs no I/O happens here, when parameters are parsed; checks that need to
look at the data (label column, split sizes) happen in ``inspect_data`` before anything is
written. Field names are unique across sections because CLI flags mirror them.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from integrations.catalog import resolve_dataset, resolve_model


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DataParams(_Section):
    """Which data to use and how to split and normalise it."""

    dataset: str = Field(
        "digits",
        title="Dataset",
        description="Built-in dataset ('digits', 'tabular') or an import path "
        "'package.module:loader' returning (features, labels).",
    )
    url: str | None = Field(
        None,
        title="Data URL",
        description="For 'tabular': URL of a CSV or Parquet file (file://, s3://, any fsspec URL).",
    )
    label_column: str | None = Field(
        None, title="Label column", description="For 'tabular': the column holding the class label."
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
    split_seed: int = Field(0, title="Split seed", description="Seed of the stratified split.")
    normalize: bool = Field(
        True,
        title="Normalise",
        description="Standardise features with mean and std fitted on the training split only.",
    )

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
        description="Built-in model ('mlp', 'cnn') or an import path 'package.module:factory' "
        "called as factory(input_shape, num_classes, **options).",
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


class TrainingParams(_Section):
    """How to train: workers, epochs, optimiser, fault tolerance."""

    workers: int = Field(2, ge=1, title="Workers", description="Ray Train workers (data-parallel).")
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


class RegistryParams(_Section):
    """Where the model is registered and when it is promoted."""

    model_name: str = Field(
        "digits-classifier",
        min_length=1,
        title="Registered model name",
        description="Name of the model in the MLflow registry.",
    )
    metric: Literal["accuracy", "macro_f1", "loss"] = Field(
        "accuracy", title="Promotion metric", description="Test metric compared with the champion."
    )
    direction: Literal["maximize", "minimize"] = Field(
        "maximize", title="Direction", description="Whether a higher or lower metric is better."
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


class TrainModelParams(_Section):
    """Parameters of ``train_model``: data, model, training and registry sections."""

    experiment: str = Field(
        "prefect-ml", min_length=1, title="Experiment", description="MLflow experiment name."
    )
    data: DataParams = Field(default_factory=DataParams, title="Data")
    model: ModelParams = Field(default_factory=ModelParams, title="Model")
    training: TrainingParams = Field(default_factory=TrainingParams, title="Training")
    registry: RegistryParams = Field(default_factory=RegistryParams, title="Registry")

    def run_key(self, fingerprint: str) -> str:
        """Identity of a training run: the same command on the same data resumes the same run."""
        identity = {
            "experiment": self.experiment,
            "fingerprint": fingerprint,
            "model": self.model.model_dump(mode="json"),
            "training": self.training.model_dump(
                mode="json", exclude={"max_failures", "cpus_per_worker"}
            ),
        }
        return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


class PipelineParams(TrainModelParams):
    """Parameters of ``ml_pipeline``; the sweep and serve sections plug in here."""
