"""The sweep section: what a campaign searches, how it chooses, its budget and its width.

The search space is declared (a dict of dimensions, each optionally active only when another
drew given values) or defined by run: a function ``space(trial) -> dict`` named by its import
path or plug-in name (:mod:`integrations.campaign`). Either sets model and training fields
that carry no :class:`~prefect_ml.integrations.config.Role` (operational, early stopping, not
searchable), and the options of the user's own model and dataset loader as
``model_options.<key>`` and ``dataset_options.<key>`` (a trial that sets the latter trains on
data prepared with them).
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    TypeAdapter,
    ValidationError,
    WrapValidator,
    field_serializer,
    field_validator,
    model_validator,
)
from pydantic.json_schema import SkipJsonSchema

from prefect_ml.integrations import plugins, problems
from prefect_ml.integrations.config._base import Section, searchable
from prefect_ml.integrations.config.model import ModelParams
from prefect_ml.integrations.config.resources import (
    CustomResources,
    Reserve,
    Reserving,
    accelerator_field,
    memory_field,
    resources_field,
)
from prefect_ml.integrations.config.training import METRIC_NAME, TrainingParams

EPOCH_METRICS = tuple(problems.EPOCH_METRICS)  # of every task type; each flow checks its own


# Grid search: values per dimension and trials in the whole grid, checked before any is built
# (Optuna's GridSampler holds every combination in memory).
MAX_GRID_POINTS = 10_000
MAX_GRID_TRIALS = 100_000


class SearchDimension(Section):
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
    when: dict[str, list[str | int | float | bool]] | None = Field(
        None,
        title="Only when",
        description="Drawn only when each named categorical dimension drew one of these "
        'values, e.g. {"optimizer": ["sgd"]}; absent from the other trials.',
    )

    @field_validator("when", mode="before")
    @classmethod
    def _one_value_or_several(cls, when: Any) -> Any:
        if isinstance(when, dict):
            return {k: v if isinstance(v, list) else [v] for k, v in when.items()}
        return when

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


# A define-by-run space given as the function itself (Python API only: not in the UI form).
SearchSpaceFunction = Callable[..., Any]
_DECLARED = TypeAdapter(dict[str, SearchDimension])


def _one_form(value: Any, handler: Any) -> Any:
    """A dict is validated as dimensions (errors located at their names, not at each form of
    the union); a name or a function is kept as it is, checked by the section."""
    if isinstance(value, dict):
        return _DECLARED.validate_python(value)
    if isinstance(value, str) or callable(value):
        return value
    raise ValueError(
        "a search space is a dict of dimensions, 'package.module:function' or a plug-in's name"
    )


def default_search_space() -> dict[str, SearchDimension]:
    return {
        "lr": SearchDimension(type="float", low=1e-4, high=1e-1, log=True),
        "hidden": SearchDimension(type="int", low=32, high=256),
        "dropout": SearchDimension(type="float", low=0.0, high=0.5),
        "optimizer": SearchDimension(type="categorical", choices=["adam", "sgd"]),
    }


class SweepParams(Reserving):
    """The campaign: what to search, how to choose, how much to spend and how wide to run."""

    campaign: str = Field(
        "default",
        min_length=1,
        max_length=100,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
        title="Campaign name",
        description="Names the Optuna study; running the same name again continues it.",
    )
    search_space: Annotated[
        dict[str, SearchDimension] | str | SkipJsonSchema[SearchSpaceFunction],
        WrapValidator(_one_form),
    ] = Field(
        default_factory=default_search_space,
        title="Search space",
        description='Tuned parameters, e.g. {"lr": {"type": "float", "low": 1e-4, "high": 0.1, '
        '"log": true}}; names are model or training parameters, model_options.<key> for '
        "the model's own options or dataset_options.<key> for a dataset loader's (the data "
        "is prepared once per distinct options). Or a define-by-run space: "
        "'package.module:function' (or a 'prefect_ml.search_spaces' plug-in) called as "
        "function(trial) -> dict.",
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
    trial_cpus: Annotated[float, Reserve.CPUS] = Field(
        1.0, gt=0, title="CPUs per trial", description="CPUs per trial."
    )
    trial_gpus: Annotated[float, Reserve.GPUS] = Field(
        0.0, ge=0, title="GPUs per trial", description="GPUs per trial (per worker with >1)."
    )
    trial_accelerator_type: Annotated[str | None, Reserve.ACCELERATOR_TYPE] = accelerator_field(
        "GPU type per trial", "trials", "trial_gpus"
    )
    trial_memory_gb: Annotated[float | None, Reserve.MEMORY] = memory_field(
        "Memory per trial (GB)", "each trial (each worker with >1)"
    )
    trial_resources: Annotated[CustomResources, Reserve.CUSTOM] = resources_field(
        "Custom resources per trial", "trials"
    )
    trial_workers: Annotated[int, Reserve.COUNT] = Field(
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
        # A model of one's own may log its objective (self.log): any metric name; the flow
        # checks a built-in model's against its task type.
        unknown = [name for name in self.objectives if not re.fullmatch(METRIC_NAME, name)]
        if unknown:
            raise ValueError(
                f"objective {unknown} is not a metric name; choose from {list(EPOCH_METRICS)} "
                "or a metric your model logs"
            )
        if len(self.objectives) > 1 and "pruner" in self.model_fields_set and self.pruner != "none":
            raise ValueError("pruning needs a single objective; set --pruner none")
        if self.trial_accelerator_type and not self.trial_gpus:
            raise ValueError("trial_accelerator_type places GPU trials: set --trial-gpus as well")
        if isinstance(self.search_space, dict):
            _check_declared(self.search_space, grid=self.sampler == "grid")
        else:
            _check_function(self.search_space)
            if self.sampler == "grid":
                raise ValueError(
                    "search_space: grid search enumerates every dimension's values before the "
                    "first trial, and a define-by-run space only shows its dimensions as it "
                    "runs; use --sampler tpe (or random, cmaes), or declare the space as a dict "
                    "with steps"
                )
        return self

    @field_serializer("search_space", when_used="json")
    def _space_as_text(self, space: Any) -> Any:
        return space_text(space) if callable(space) else space

    @property
    def conditional(self) -> bool:
        """Whether trials may draw different dimensions: a define-by-run space, or a declared
        one with conditions."""
        space = self.search_space
        return not isinstance(space, dict) or any(d.when for d in space.values())

    @property
    def effective_pruner(self) -> str:
        return self.pruner if len(self.objectives) == 1 else "none"


# The sections a campaign searches, by name: its fields that carry no role are tunable.
SEARCHABLE_SECTIONS: dict[str, type[Section]] = {"model": ModelParams, "training": TrainingParams}


def section_of(name: str) -> str | None:
    """The searchable section (``model`` or ``training``) that has a field ``name``."""
    return next((s for s, m in SEARCHABLE_SECTIONS.items() if name in m.model_fields), None)


# A user's own options, set by name under these prefixes: its model factory's
# (``model_options.blocks``) and its dataset loader's (``dataset_options.noise``).
MODEL_OPTION = "model_options."
DATASET_OPTION = "dataset_options."
OPTION_PREFIXES = (MODEL_OPTION, DATASET_OPTION)


def tunable_names() -> list[str]:
    """The names a search space may set, with the form of a user model's options."""
    fields = sorted(n for m in SEARCHABLE_SECTIONS.values() for n in searchable(m))
    return [*fields, *(f"{prefix}<key>" for prefix in OPTION_PREFIXES)]


def check_tunable(name: str) -> None:
    """``name`` is a tunable model or training field, or an option of the user's model or
    dataset loader.

    Raises:
        ValueError: naming the close matches and every tunable name.
    """
    if name.startswith(OPTION_PREFIXES) and name.partition(".")[2]:
        return
    section = section_of(name)
    if section is not None and name in searchable(SEARCHABLE_SECTIONS[section]):
        return
    tunable = tunable_names()
    close = difflib.get_close_matches(name, [n.removesuffix("<key>") for n in tunable], n=3)
    hint = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
    raise ValueError(f"'{name}' is not a tunable parameter; {hint}use one of {tunable}")


def _check_searchable(name: str, dimension: SearchDimension) -> None:
    """``name`` is tunable and every candidate value is valid for it (a user model's options
    are checked against its factory with the model section)."""
    try:
        check_tunable(name)
    except ValueError as exc:
        raise ValueError(f"search_space: {exc}") from None
    section = section_of(name)
    if section is None:
        return
    model = SEARCHABLE_SECTIONS[section]
    for value in dimension.candidate_values():
        try:
            model.model_validate({name: value})
        except ValidationError as exc:
            problem = exc.errors()[0]["msg"]
            raise ValueError(
                f"search_space.{name}: {value!r} is not a valid {name}: {problem}"
            ) from None


def _check_declared(space: dict[str, SearchDimension], *, grid: bool) -> None:
    """Every dimension tunable, every condition on a categorical dimension's choices, no cycle;
    for grid search, an unconditional grid of bounded size."""
    for name, dimension in space.items():
        _check_searchable(name, dimension)
        for parent, values in (dimension.when or {}).items():
            where = f"search_space.{name}.when"
            if parent not in space:
                raise ValueError(f"{where}: '{parent}' is not a dimension of the space")
            choices = space[parent].choices
            if space[parent].type != "categorical" or choices is None:
                raise ValueError(
                    f"{where}: '{parent}' is a range; a condition names a categorical dimension"
                )
            unknown = [v for v in values if v not in choices]
            if unknown:
                raise ValueError(
                    f"{where}: '{parent}' has no choice {unknown}; its choices are {choices}"
                )
    drawing_order(space)
    if not grid:
        return
    if any(d.when for d in space.values()):
        raise ValueError(
            "search_space: grid search needs the same dimensions in every trial; drop the "
            "'when' conditions or use --sampler tpe"
        )
    trials = 1
    for name, dimension in space.items():
        try:
            trials *= len(dimension.grid())
        except ValueError as exc:
            raise ValueError(f"search_space.{name}: {exc}") from exc
    if trials > MAX_GRID_TRIALS:
        sizes = {name: d.grid_size() for name, d in space.items()}
        raise ValueError(
            f"search_space: the grid has {trials:,} combinations {sizes}, more than "
            f"{MAX_GRID_TRIALS:,}; coarsen the largest dimension"
        )


def drawing_order(space: dict[str, SearchDimension]) -> list[str]:
    """The dimensions in the order a trial draws them: each after those its condition names.

    Raises:
        ValueError: for conditions that name each other in a cycle.
    """
    order: list[str] = []
    pending = dict(space)
    while pending:
        ready = [n for n, d in pending.items() if all(p in order for p in (d.when or {}))]
        if not ready:
            raise ValueError(
                f"search_space: the conditions of {sorted(pending)} name each other in a cycle"
            )
        order.extend(ready)
        for name in ready:
            del pending[name]
    return order


def space_text(space: dict[str, SearchDimension] | str | SearchSpaceFunction) -> str:
    """A search space as a user writes it: its JSON, or the function's import path."""
    if isinstance(space, dict):
        return json.dumps({k: v.model_dump(exclude_none=True) for k, v in space.items()})
    if isinstance(space, str):
        return space
    return f"{getattr(space, '__module__', '?')}:{getattr(space, '__qualname__', repr(space))}"


def _check_function(space: str | SearchSpaceFunction) -> None:
    """A define-by-run space's name is a plug-in or an allowed import path (nothing imported
    here: :mod:`integrations.campaign` imports it and asks it for a trial)."""
    if callable(space) or space in plugins.registered(plugins.SEARCH_SPACE_GROUP):
        return
    if ":" not in space:
        raise ValueError(
            f"search_space: {space!r} is neither an import path 'package.module:function' nor "
            f"a plug-in of {sorted(plugins.registered(plugins.SEARCH_SPACE_GROUP))} (entry points "
            f"of the group '{plugins.SEARCH_SPACE_GROUP}')"
        )
    plugins.check_allowed(space, group=plugins.SEARCH_SPACE_GROUP, field="sweep.search_space")
