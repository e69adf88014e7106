"""The model section: which network to train and its shape."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, model_validator

from prefect_ml.integrations.config._base import Role, Section
from prefect_ml.integrations.datasets import explicit_parameters, resolve_model


class ModelParams(Section):
    """Which network to train and its shape."""

    model: Annotated[str, Role.NOT_SEARCHABLE] = Field(
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
    model_options: Annotated[dict[str, Any], Role.NOT_SEARCHABLE] = Field(
        default_factory=dict,
        title="Model options",
        description="Extra keyword arguments for a user model factory.",
    )

    @model_validator(mode="after")
    def _check_model(self) -> ModelParams:
        resolve_model(self.model, list(self.model_options))
        return self

    def factory_options(self) -> dict[str, Any]:
        """What the factory receives besides the shape: ``model_options``, and those of the
        built-in models' fields (``hidden``, ``depth``, ``channels``, ``dropout``) that it
        names in its signature (a ``**kwargs`` names none of them)."""
        shape: dict[str, Any] = {"hidden": self.hidden, "depth": self.depth}
        shape.update(channels=self.channels, dropout=self.dropout)
        named = explicit_parameters(resolve_model(self.model))
        return {**{k: v for k, v in shape.items() if k in named}, **self.model_options}
