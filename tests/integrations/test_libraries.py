"""The heavy libraries, imported on first use, and the pip command that installs a missing one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from prefect_ml.integrations.libraries import install_hint, lazy_import
from tests.conftest import REPO_ROOT


def test_a_declared_library_is_the_real_module_from_its_first_use_on() -> None:
    """That the declaration itself imports nothing is tests/flows/test_cli.py's to show: the
    flows import integrations.campaign, whose _studies declares Optuna, and load no Optuna."""
    declared = lazy_import("json")
    assert repr(declared) == "<module 'json', imported on first use>"
    assert declared.dumps is json.dumps
    assert repr(declared) == "<module 'json', imported>"


def test_a_missing_library_names_the_extra_that_installs_it() -> None:
    dashboard = lazy_import("optuna_dashboard")  # pyproject.toml's `dashboard` extra
    with pytest.raises(ModuleNotFoundError) as missing:
        dashboard.run_server  # noqa: B018
    assert "pip install 'prefect-ml[dashboard]'" in str(missing.value)
    assert missing.value.name == "optuna_dashboard"  # as Python's own: errors.fix_for reads it


def test_a_dependency_is_installed_with_prefect_ml_itself() -> None:
    assert install_hint("optuna") == "pip install prefect-ml"
    assert install_hint("sklearn") == "pip install prefect-ml"  # an import name we do not declare


def test_a_library_whose_own_dependency_is_missing_raises_python_s_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the library asked for is ours to name; what it imports is its own business."""
    (tmp_path / "half_installed.py").write_text("import not_installed_anywhere\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="No module named 'not_installed_anywhere'"):
        lazy_import("half_installed").anything  # noqa: B018


# A fresh interpreter: which modules the training package's face loads for a user contract.
_FACE_PROBE = """
import sys
from prefect_ml.integrations import training
WATCHED = ("torch", "ray", "prefect_ml.integrations.training._hooks")
before = sorted(m for m in WATCHED if m in sys.modules)
check = training.check_contract
after = sorted(m for m in WATCHED if m in sys.modules)
assert training.check_contract is check is vars(training)["check_contract"]
try:
    training.no_such_name
except AttributeError as exc:
    print(before, after, "no_such_name" in str(exc))
"""


def test_a_package_face_loads_each_name_s_module_on_first_use() -> None:
    """The training face (``lazy_exports``) loads the contract checks' module when a name of it
    is asked for, and not torch or Ray, which its worker and launcher modules import."""
    run = subprocess.run(
        [sys.executable, "-c", _FACE_PROBE], cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split("\n")[0] == "[] ['prefect_ml.integrations.training._hooks'] True"
