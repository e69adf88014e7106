"""The contracts of user code have one home: ``integrations/contracts.py``, on the ground floor
(it imports nothing of prefect-ml, nor torch), the public names are its classes, and the API
page documents every one of them."""

from __future__ import annotations

import inspect
import subprocess
import sys
from typing import Protocol

import prefect_ml
from prefect_ml.integrations import contracts
from tests.helpers import REPO_ROOT, docs_hook

_IMPORT_PROBE = """
import sys
import prefect_ml.integrations
before = set(sys.modules)
import prefect_ml.integrations.contracts
heavy = sorted(m for m in ("torch", "numpy", "optuna", "ray") if m in sys.modules)
print(sorted(set(sys.modules) - before), heavy)
"""


def _protocols() -> set[str]:
    return {
        name
        for name, value in vars(contracts).items()
        if inspect.isclass(value)
        and value.__module__ == contracts.__name__
        and Protocol in value.__mro__
    }


def test_the_contracts_module_imports_nothing_of_the_project_nor_torch() -> None:
    run = subprocess.run(
        [sys.executable, "-c", _IMPORT_PROBE], cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "['prefect_ml.integrations.contracts'] []"


def test_the_public_contracts_are_the_ones_defined_there() -> None:
    assert _protocols() == {
        "DatasetLoader",
        "ModelFactory",
        "TrainingModule",
        "ModelParallelHooks",
        "SearchSpace",
    }
    assert prefect_ml.TrainingModule is contracts.TrainingModule
    assert prefect_ml.SearchSpace is contracts.SearchSpace


def test_the_api_page_lists_every_contract() -> None:
    """A contract added to the module and not to the docs' list fails here."""
    listed = set(docs_hook("reference").CONTRACTS)
    assert contracts.__name__ in listed
    assert {f"{contracts.__name__}.{name}" for name in _protocols()} <= listed
