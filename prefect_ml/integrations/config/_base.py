"""What every section model shares: validation on assignment, defaults shown in the UI form,
and the roles a field plays, declared on the field itself."""

from __future__ import annotations

import enum
from typing import Any

from pydantic import BaseModel, ConfigDict
from pydantic_core import to_jsonable_python


def _factory_defaults(schema: dict[str, Any], model: type[BaseModel]) -> None:
    """Write ``default_factory`` values into the JSON schema, so UI forms start from them."""
    properties = schema.get("properties", {})
    for name, field in model.model_fields.items():
        if field.default_factory is not None and name in properties:
            default = field.default_factory()  # type: ignore[call-arg]
            properties[name]["default"] = to_jsonable_python(default)


class Section(BaseModel):
    """A section of the flow parameters: one concept, its fields unique across sections
    (CLI flags mirror them), unknown fields refused."""

    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, json_schema_extra=_factory_defaults
    )


class Role(enum.Enum):
    """What a field is to a run, marked on it: ``Annotated[int, Role.OPERATIONAL]``."""

    # How a run is executed or stored, not what it computes: changing it resumes the same run,
    # and a campaign cannot tune it. Workers, strategy and layout are such fields because
    # checkpoints restore under any layout: a run resumed on more or fewer workers, or sharded
    # differently, is the same run.
    OPERATIONAL = "operational"
    # Shapes the result (which epochs train, which one is registered), so it is part of the
    # identity, but only when early stopping is on; a campaign's trials train every epoch (its
    # pruner stops them), so it is never tuned.
    EARLY_STOPPING = "early stopping"
    # Shapes the result, but a campaign cannot tune it (which network, its free-form options).
    NOT_SEARCHABLE = "not searchable"


def fields_with(model: type[BaseModel], *roles: Role) -> frozenset[str]:
    """The names of ``model``'s fields marked with any of ``roles``."""
    return frozenset(
        name
        for name, field in model.model_fields.items()
        if any(marker in roles for marker in field.metadata)
    )


def searchable(model: type[BaseModel]) -> frozenset[str]:
    """The fields of ``model`` a campaign may tune: those marked with no role."""
    return frozenset(model.model_fields) - fields_with(model, *Role)
