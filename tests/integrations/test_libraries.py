"""The heavy libraries, imported on first use, and the pip command that installs a missing one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefect_ml.integrations.libraries import install_hint, lazy_import


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
