"""The predict section: which registered version scores which files, and how."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from prefect_ml.integrations import storage
from prefect_ml.integrations.config._base import Section
from prefect_ml.integrations.config.registry import DEFAULT_MODEL_NAME, RegisteredModelName
from prefect_ml.integrations.errors import ConfigurationError


class PredictParams(Section):
    """Parameters of ``batch_predict``: which registered version scores which files, where the
    predictions go, and how the scoring actors run."""

    model_name: RegisteredModelName = DEFAULT_MODEL_NAME
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
