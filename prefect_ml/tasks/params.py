"""The flows' parameters: the sections (:mod:`prefect_ml.integrations.config`, one module
each) composed into what each flow takes, and the public tasks' keyword options mapped onto
them. Prefect validates these models and renders them as UI forms.

Every check that needs no I/O happens when parameters are parsed; checks that need to look at
the data (label column, split sizes) happen in ``inspect_data`` before anything is written.
Field names are unique across sections because CLI flags and keyword options mirror them.
"""

from __future__ import annotations

import difflib
import hashlib
import json
from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from prefect_ml.integrations import problems, tracking
from prefect_ml.integrations.campaign import first_draw, with_values
from prefect_ml.integrations.config import (
    DataParams,
    ModelParams,
    PredictParams,
    RegistryParams,
    SearchDimension,
    Section,
    ServingParams,
    SweepParams,
    TrainingParams,
)
from prefect_ml.integrations.config.registry import DEFAULT_MODEL_NAME, RegisteredModelName
from prefect_ml.integrations.config.sweep import (
    DATASET_OPTION,
    MODEL_OPTION,
    default_search_space,
    space_text,
)
from prefect_ml.integrations.datasets import BUILTIN_MODELS, resolve_model
from prefect_ml.integrations.errors import ConfigurationError

__all__ = [
    "CampaignParams",
    "DataParams",
    "ModelParams",
    "PipelineParams",
    "PredictParams",
    "RegistryParams",
    "SearchDimension",
    "ServeModelParams",
    "ServingParams",
    "SweepParams",
    "TrainModelParams",
    "TrainingParams",
    "TrainingSections",
    "default_search_space",
    "params_from_options",
    "refuse_options_beside",
    "section_options",
    "with_trial_values",
]


class TrainingSections(Section):
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
        # A model of one's own may log any epoch metric (self.log): the first epoch checks it.
        own_model = self.model.model not in BUILTIN_MODELS
        for field, metric in named:
            known = problem.test_metrics if field == "registry.metric" else problem.epoch_metrics
            logged = own_model and field != "registry.metric"
            if metric != "none" and metric not in known and not logged:
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
            if unknown and not own_model:
                raise ValueError(
                    f"sweep.objectives: {problem.name} produces no {unknown}; choose from "
                    f"{list(problem.epoch_metrics)}"
                )
        return self

    @model_validator(mode="after")
    def _check_search_space(self) -> TrainingSections:
        """A sweep's user model options are ones its factory accepts; a define-by-run space is
        asked for one trial (in memory) and what it sets is checked as a trial's values."""
        sweep: SweepParams | None = getattr(self, "sweep", None)
        if sweep is None:
            return self
        space = sweep.search_space
        if isinstance(space, dict):
            self._check_declared_options(space)
            return self
        source = space_text(space)

        def check(values: dict[str, Any]) -> None:
            try:
                with_trial_values(self.training_sections(), values)
            except ValidationError as exc:
                error = exc.errors()[0]
                where = ".".join(str(part) for part in error["loc"][1:2])
                message = error["msg"].removeprefix("Value error, ")
                what = f"{where} = {values[where]!r}" if where in values else f"{values}"
                raise ConfigurationError(
                    "sweep.search_space", f"{source} sets {what}, refused: {message}"
                ) from None

        first_draw(space, check)
        return self

    def _check_declared_options(self, space: dict[str, SearchDimension]) -> None:
        """The options a declared space tunes are ones the user's factory and loader accept."""
        models = [n.removeprefix(MODEL_OPTION) for n in space if n.startswith(MODEL_OPTION)]
        loaders = [n.removeprefix(DATASET_OPTION) for n in space if n.startswith(DATASET_OPTION)]
        try:
            if models:
                resolve_model(self.model.model, [*self.model.model_options, *models])
            if loaders:
                options = {**self.data.dataset_options, **dict.fromkeys(loaders)}
                DataParams.model_validate({**dict(self.data), "dataset_options": options})
        except ConfigurationError as exc:
            raise ValueError(f"sweep.search_space: {exc.message}") from None
        except ValidationError as exc:
            message = exc.errors()[0]["msg"].removeprefix("Value error, ")
            raise ValueError(f"sweep.search_space: {message}") from None

    def training_sections(self) -> TrainingSections:
        """The experiment, data, model and training sections alone (no sweep to check)."""
        if type(self) is TrainingSections:
            return self
        names = set(TrainingSections.model_fields)
        return TrainingSections.model_validate(self.model_dump(include=names))

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


class CampaignParams(TrainingSections):
    """Parameters of ``hpo_campaign``: data, model and fixed training values, and the search."""

    sweep: SweepParams = Field(
        default_factory=SweepParams,
        title="Sweep",
        description="What to search, how to choose, the budget and the parallelism.",
    )


class ServeModelParams(Section):
    """Parameters of ``serve_model``: which registered version, and how to serve it."""

    model_name: RegisteredModelName = DEFAULT_MODEL_NAME
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
    """``params`` with a trial's tuned values put into their sections (validated): fields
    (``lr``) and the user model's options (``model_options.blocks``)."""
    merged = with_values(params.model_dump(), values)
    return type(params).model_validate(merged)


Params = TypeVar("Params", bound=BaseModel)


def section_options(*sections: BaseModel) -> dict[str, Any]:
    """The fields of ``sections`` set by whoever made them, as one flat dict of keyword options:
    what a flow passes to the public tasks. Unset fields keep their defaults there, and checks
    that look at what was set (a pruner named with several objectives) see the same."""
    return {k: v for section in sections for k, v in section.model_dump(exclude_unset=True).items()}


def refuse_options_beside(given: object, options: Mapping[str, Any], *, step: str) -> None:
    """A public task takes its sections (what the flows pass) or keyword options, not both.

    Raises:
        ConfigurationError: naming the first option, when both were given.
    """
    if given is not None and options:
        raise ConfigurationError(
            sorted(options)[0],
            f"{step}() takes its sections or keyword options, not both; set "
            f"{sorted(options)} in the sections",
        )


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
        and issubclass(field.annotation, Section)
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
