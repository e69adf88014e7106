"""The flags of a flow's parameter model, and the flags given turned back into that model.

Flags are generated from the models, so they always mirror the parameter names
(``training.batch_size`` -> ``--batch-size``): one option per leaf field, its help the field's
description and default. An optional section (``sweep`` of the pipeline) is switched on by
giving any of its flags.
"""

from __future__ import annotations

import json
import os
import types
import typing
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import click
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from prefect_ml.flows.cli._output import print_validation_error

Parameters = TypeVar("Parameters", bound=BaseModel)


def parameter_flags(model: type[BaseModel]) -> Callable[[Callable[..., Any]], Any]:
    """Add one option per parameter of ``model``, the way ``@click.option`` does."""

    def decorate(function: Callable[..., Any]) -> Any:
        options = [_click_option(name, field) for _s, name, field in _parameter_fields(model)]
        # click reverses the collected list when it builds the command.
        function.__click_params__ = [  # type: ignore[attr-defined]
            *getattr(function, "__click_params__", []),
            *reversed(options),
        ]
        return function

    return decorate


def parse_parameters(model: type[Parameters], flags: dict[str, Any]) -> Parameters:
    """Validate flags into the flow's parameter model, or exit 2 naming each bad field."""
    return validated(model, nested_parameters(model, flags))


def validated(model: type[Parameters], nested: dict[str, Any]) -> Parameters:
    """``model`` from its nested dict, or exit 2 with a table of the invalid fields."""
    try:
        return model.model_validate(nested)
    except ValidationError as exc:
        print_validation_error(exc)
        raise SystemExit(2) from exc


def nested_parameters(model: type[BaseModel], flags: dict[str, Any]) -> dict[str, Any]:
    """Turn the given (non-None) flags into the nested dict the parameter model expects."""
    nested: dict[str, Any] = {}
    for section, name, field in _parameter_fields(model):
        value = flags.get(name)
        if value is None:
            continue
        mapping, text = _mapping_or_text(field)
        if mapping:
            value = _mapping_flag(name, value, text=text)
        (nested.setdefault(section, {}) if section else nested)[name] = value
    return nested


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The model of a section field (``Section`` or ``Section | None``), or None for a leaf."""
    candidates = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    first = candidates[0]
    return first if isinstance(first, type) and issubclass(first, BaseModel) else None


def _parameter_fields(model: type[BaseModel]) -> Iterator[tuple[str | None, str, FieldInfo]]:
    """(section, name, field) for every leaf parameter; section is None for top-level ones."""
    for name, field in model.model_fields.items():
        section = _section_model(field.annotation)
        if section is not None:
            for leaf, leaf_field in section.model_fields.items():
                yield name, leaf, leaf_field
        else:
            yield None, name, field


def _mapping_or_text(field: FieldInfo) -> tuple[bool, bool]:
    """Whether a field takes a mapping, and whether it takes text as well (a search space is a
    dict or the import path of a function)."""
    annotation = field.annotation
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    forms = typing.get_args(annotation) if _is_union(annotation) else (annotation,)
    mapping = any(typing.get_origin(form) is dict for form in forms)
    return mapping, mapping and str in forms


def _is_union(annotation: Any) -> bool:
    return isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union


def _typed_default(field: FieldInfo) -> str:
    """A field's default as a user types it: a mapping as JSON, not as Python's repr."""
    default = field.get_default(call_default_factory=True)
    if isinstance(default, dict) and default:
        return json.dumps(
            {
                k: v.model_dump(mode="json", exclude_defaults=True)
                if isinstance(v, BaseModel)
                else v
                for k, v in default.items()
            }
        )
    return str(default)


def _click_option(name: str, field: FieldInfo) -> click.Option:
    flag = "--" + name.replace("_", "-")
    annotation = field.annotation
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if _is_union(annotation):
        annotation = args[0]
    help_text = f"{field.description} [default: {_typed_default(field)}]"
    mapping, text = _mapping_or_text(field)
    if mapping:
        also = ", or the path of a JSON/YAML file" + (", or an import path" if text else "")
        help_text += f" (inline JSON/YAML{also})"
        return click.Option([flag, name], type=str, default=None, help=help_text)
    if annotation is bool:
        return click.Option([f"{flag}/--no-{flag[2:]}", name], default=None, help=help_text)
    if typing.get_origin(annotation) is typing.Literal:
        choice = click.Choice([str(c) for c in typing.get_args(annotation)])
        return click.Option([flag, name], type=choice, default=None, help=help_text)
    # A union of kinds (``workers``: a count or a range) arrives as text for the model to parse.
    numeric = annotation in (int, float) and len(args) <= 1
    click_type: type = annotation if numeric else str  # type: ignore[assignment]
    return click.Option([flag, name], type=click_type, default=None, help=help_text)


def _mapping_flag(name: str, value: str, *, text: bool = False) -> Any:
    """A dict flag: inline JSON or YAML, or the path of a file holding either; with ``text``,
    a plain word stays a string (``--search-space my_project.spaces:space``)."""
    import yaml

    hint = "--" + name.replace("_", "-")
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as handle:
            value = handle.read()
    try:
        loaded = yaml.safe_load(value)
    except yaml.YAMLError as exc:
        raise click.BadParameter(f"not valid JSON or YAML: {exc}", param_hint=hint) from exc
    if text and isinstance(loaded, str):
        return loaded
    if not isinstance(loaded, dict):
        raise click.BadParameter("expected a mapping, e.g. '{\"key\": ...}'", param_hint=hint)
    return loaded
