"""The registry section: where the model is registered and when it takes the alias."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from prefect_ml.integrations import problems
from prefect_ml.integrations.config._base import Section

# The registered model's name, as every section that names one declares it (registry, serving,
# batch scoring).
DEFAULT_MODEL_NAME = "digits-classifier"
RegisteredModelName = Annotated[
    str,
    Field(
        min_length=1,
        title="Registered model name",
        description="Name of the model in the MLflow registry.",
    ),
]


class RegistryParams(Section):
    """Where the model is registered and when it is promoted."""

    model_name: RegisteredModelName = DEFAULT_MODEL_NAME
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
