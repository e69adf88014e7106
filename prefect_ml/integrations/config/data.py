"""The data section: which dataset, and how it is split and normalised."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from prefect_ml.integrations import problems, storage
from prefect_ml.integrations.config._base import Section
from prefect_ml.integrations.datasets import resolve_dataset


class DataParams(Section):
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
            if self.dataset_options:
                raise ValueError(
                    f"dataset_options {sorted(self.dataset_options)} are a user dataset "
                    "loader's keyword arguments; the 'tabular' dataset takes none (it reads "
                    "url and label_column)"
                )
        resolve_dataset(self.dataset, self.loader_options())
        if self.val_fraction + self.test_fraction >= 0.8:
            raise ValueError("val_fraction + test_fraction must leave at least 20% for training")
        return self
