"""A campaign's search space as one thing: a function of an Optuna trial that draws values.

Optuna's own idiom is define-by-run: ``trial.suggest_*`` calls inside any ``if`` and ``for``
(Ray Tune's ``OptunaSearch(space=fn)`` takes the same function). A campaign's space is always
such a function here: the user's own (:class:`SearchSpace` of :mod:`integrations.contracts`,
named ``package.module:function`` or by a ``prefect_ml.search_spaces`` plug-in, or passed as the
function in Python), or the declarative dict of the sweep section turned into one
(:class:`DeclaredSpace`, whose conditions are its ``if``).

What a space returns names what each trial sets: model and training fields (``lr``,
``training.lr``), and the options of the user's own model and dataset loader
(``model_options.blocks``, ``dataset_options.noise``), as dotted names or nested sections
(``{"model": {"model_options": {"blocks": 3}}}``);
:func:`tuned_values` turns either into one flat dict of those names.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from prefect_ml.integrations import plugins
from prefect_ml.integrations.campaign._studies import draw_once
from prefect_ml.integrations.config.sweep import (
    SearchDimension,
    check_tunable,
    drawing_order,
    section_of,
    space_text,
)
from prefect_ml.integrations.contracts import SearchSpace
from prefect_ml.integrations.datasets import import_callable
from prefect_ml.integrations.errors import ConfigurationError

FIELD = "sweep.search_space"
# Mappings whose keys are names inside them: the sections and the options.
CONTAINERS = {"model", "training", "data", "model_options", "dataset_options"}
SECTIONS = ("model", "training", "data")
# The section that holds each kind of the user's own options.
OPTION_SECTIONS = {"model_options": "model", "dataset_options": "data"}


@dataclass(frozen=True)
class DeclaredSpace:
    """The sweep section's dict of dimensions as a define-by-run space: each dimension drawn
    in :func:`drawing_order`, a conditional one only when its condition holds."""

    dimensions: dict[str, SearchDimension]

    def __call__(self, trial: Any) -> dict[str, Any]:
        drawn: dict[str, Any] = {}
        for name in drawing_order(self.dimensions):
            dimension = self.dimensions[name]
            when = dimension.when or {}
            if all(
                parent in drawn and drawn[parent] in allowed for parent, allowed in when.items()
            ):
                drawn[name] = suggest(trial, name, dimension)
        return drawn


def suggest(trial: Any, name: str, dimension: SearchDimension) -> Any:
    """One declared dimension drawn with Optuna's public ``suggest_*``."""
    if dimension.type == "categorical":
        return trial.suggest_categorical(name, dimension.choices)
    assert dimension.low is not None and dimension.high is not None  # checked by the section
    if dimension.type == "int":
        step = int(dimension.step or 1)
        return trial.suggest_int(
            name, int(dimension.low), int(dimension.high), step=step, log=dimension.log
        )
    return trial.suggest_float(
        name, dimension.low, dimension.high, step=dimension.step, log=dimension.log
    )


def resolve_space(space: dict[str, SearchDimension] | str | Callable[..., Any]) -> SearchSpace:
    """The space a sweep section names: declared, a plug-in, an allowed import path, or the
    function itself.

    Raises:
        ConfigurationError: naming ``sweep.search_space``: not allowed, not importable, not
            callable (see :func:`integrations.datasets.import_callable`).
    """
    if isinstance(space, dict):
        return DeclaredSpace(space)
    if not isinstance(space, str):
        return space  # type: ignore[return-value]
    registered = plugins.registered(plugins.SEARCH_SPACE_GROUP)
    path = registered.get(space, space)
    return import_callable(path, group=plugins.SEARCH_SPACE_GROUP, field=FIELD)  # type: ignore[return-value]


def tuned_values(returned: object, *, source: str) -> dict[str, Any]:
    """What a space returned, as ``{name: value}`` with names as the sweep section writes
    them: a field (``lr``) or an option (``model_options.blocks``, ``dataset_options.noise``).

    Raises:
        ConfigurationError: naming ``source``: not a mapping, or a name that is not tunable
            (with the close matches).
    """
    if not isinstance(returned, Mapping):
        raise ConfigurationError(
            FIELD,
            f"{source} returned {type(returned).__name__}, not a mapping of names to values; "
            "return e.g. {'lr': trial.suggest_float('lr', 1e-4, 0.1, log=True)}",
        )
    flat: dict[str, Any] = {}
    _flatten(returned, "", flat, source)
    if not flat:
        raise ConfigurationError(FIELD, f"{source} returned no value to tune")
    return flat


def canonical(name: str) -> str:
    """``training.lr`` -> ``lr``; ``model.model_options.blocks`` -> ``model_options.blocks``."""
    section, dot, rest = name.partition(".")
    return rest if dot and section in SECTIONS and rest else name


def _flatten(mapping: Mapping[Any, Any], prefix: str, flat: dict[str, Any], source: str) -> None:
    for key, value in mapping.items():
        if not isinstance(key, str):
            raise ConfigurationError(FIELD, f"{source} returned a key {key!r}, not a name")
        name = canonical(prefix + key)
        if name in CONTAINERS and isinstance(value, Mapping):
            _flatten(value, f"{name}.", flat, source)
            continue
        try:
            check_tunable(name)
        except ValueError as exc:
            raise ConfigurationError(FIELD, f"{source}: {exc}") from None
        if name in flat:
            raise ConfigurationError(FIELD, f"{source} sets '{name}' twice")
        flat[name] = value


def with_values(parameters: dict[str, Any], values: Mapping[str, Any]) -> dict[str, Any]:
    """``parameters`` (a flow's, dumped) with ``values`` put into their sections: a field into
    its section, an option into the model's ``model_options`` or the data's
    ``dataset_options``."""
    merged = copy.deepcopy(parameters)
    for name, value in values.items():
        option, dot, key = name.partition(".")
        if dot and option in OPTION_SECTIONS:
            merged[OPTION_SECTIONS[option]][option][key] = value
            continue
        section = section_of(name)
        assert section is not None, name  # every name was checked by tuned_values
        merged[section][name] = value
    return merged


def first_draw(
    space: dict[str, SearchDimension] | str | Callable[..., Any],
    check: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:
    """Resolve ``space``, ask it for one trial of an in-memory study and ``check`` what it
    sets: a space that cannot run fails here, naming itself and the key, before any trial.

    Raises:
        ConfigurationError: naming ``sweep.search_space``.
    """
    source = space_text(space)
    function = resolve_space(space)
    try:
        returned, _ = draw_once(function)
    except Exception as exc:
        raise ConfigurationError(
            FIELD, f"{source} raised {type(exc).__name__}: {exc}, when asked for a trial"
        ) from exc
    values = tuned_values(returned, source=source)
    check(values)
    return values
