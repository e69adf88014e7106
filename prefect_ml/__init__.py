"""prefect-ml: Prefect tasks and flows for Ray-distributed PyTorch training, Optuna campaigns
and Ray Serve, every run and model tracked in MLflow.

Compose the public tasks in your own flow: the README's example (``README.md``, "In your own
flow") does, and the tests run it as it is written there.

What this module exports (``__all__``) is the public, versioned API; ``prefect_ml.tasks`` and
``prefect_ml.integrations`` beyond it are internal. Names load on first use, so importing
``prefect_ml`` (as Prefect does for its collections) costs almost nothing.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from prefect_ml.integrations.libraries import installed_version

# Public name -> the module that defines it.
_EXPORTS = {
    "preprocess": "prefect_ml.tasks.data",
    "PreparedData": "prefect_ml.tasks.data",
    "train": "prefect_ml.tasks.train",
    "TrainResult": "prefect_ml.tasks.train",
    "evaluate": "prefect_ml.tasks.evaluate",
    "Evaluation": "prefect_ml.tasks.evaluate",
    "register": "prefect_ml.tasks.register",
    "Registration": "prefect_ml.tasks.register",
    "serve": "prefect_ml.tasks.serve",
    "ServingResult": "prefect_ml.tasks.serve",
    "campaign": "prefect_ml.tasks.sweep",
    "CampaignResult": "prefect_ml.tasks.sweep",
    "TrialSummary": "prefect_ml.tasks.sweep",
    "ml_pipeline": "prefect_ml.flows.pipeline",
    "train_model": "prefect_ml.flows.train",
    "hpo_campaign": "prefect_ml.flows.sweep",
    "serve_model": "prefect_ml.flows.serve",
    "TrainingModule": "prefect_ml.integrations.contracts",
    "SearchSpace": "prefect_ml.integrations.contracts",
    "PrefectMLSettings": "prefect_ml.integrations.settings",
    "get_settings": "prefect_ml.integrations.settings",
    "PrefectMLError": "prefect_ml.integrations.errors",
    "ConfigurationError": "prefect_ml.integrations.errors",
}

__all__ = sorted([*_EXPORTS, "__version__"])

__version__ = installed_version()

if TYPE_CHECKING:  # for type checkers and editors; at run time __getattr__ loads them
    from prefect_ml.flows.pipeline import ml_pipeline as ml_pipeline
    from prefect_ml.flows.serve import serve_model as serve_model
    from prefect_ml.flows.sweep import hpo_campaign as hpo_campaign
    from prefect_ml.flows.train import train_model as train_model
    from prefect_ml.integrations.contracts import SearchSpace as SearchSpace
    from prefect_ml.integrations.contracts import TrainingModule as TrainingModule
    from prefect_ml.integrations.errors import (
        ConfigurationError as ConfigurationError,
    )
    from prefect_ml.integrations.errors import (
        PrefectMLError as PrefectMLError,
    )
    from prefect_ml.integrations.settings import (
        PrefectMLSettings as PrefectMLSettings,
    )
    from prefect_ml.integrations.settings import (
        get_settings as get_settings,
    )
    from prefect_ml.tasks.data import PreparedData as PreparedData
    from prefect_ml.tasks.data import preprocess as preprocess
    from prefect_ml.tasks.evaluate import Evaluation as Evaluation
    from prefect_ml.tasks.evaluate import evaluate as evaluate
    from prefect_ml.tasks.register import Registration as Registration
    from prefect_ml.tasks.register import register as register
    from prefect_ml.tasks.serve import ServingResult as ServingResult
    from prefect_ml.tasks.serve import serve as serve
    from prefect_ml.tasks.sweep import (
        CampaignResult as CampaignResult,
    )
    from prefect_ml.tasks.sweep import (
        TrialSummary as TrialSummary,
    )
    from prefect_ml.tasks.sweep import (
        campaign as campaign,
    )
    from prefect_ml.tasks.train import TrainResult as TrainResult
    from prefect_ml.tasks.train import train as train


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'prefect_ml' has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name]), name)
    globals()[name] = value  # the next access skips this hook
    return value


def __dir__() -> list[str]:
    return __all__
