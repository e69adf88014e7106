"""The configuration: one pydantic model per section of the flow parameters, declared once.

A section travels unchanged from the UI form and the CLI (``prefect_ml.tasks.params`` composes
the sections into each flow's parameters) to the Ray workers and the Serve replicas, which
receive the section models themselves. What a field is to a run (operational, early stopping,
not searchable) is marked on the field (:class:`Role`), never kept in a list of names.
"""

from prefect_ml.integrations.config._base import Role, Section, fields_with, searchable
from prefect_ml.integrations.config.data import DataParams
from prefect_ml.integrations.config.model import ModelParams
from prefect_ml.integrations.config.predict import PredictParams
from prefect_ml.integrations.config.registry import RegistryParams
from prefect_ml.integrations.config.serving import ServingParams
from prefect_ml.integrations.config.sweep import SearchDimension, SweepParams
from prefect_ml.integrations.config.training import TrainingParams

__all__ = [
    "DataParams",
    "ModelParams",
    "PredictParams",
    "RegistryParams",
    "Role",
    "SearchDimension",
    "Section",
    "ServingParams",
    "SweepParams",
    "TrainingParams",
    "fields_with",
    "searchable",
]
