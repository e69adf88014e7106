"""What a cluster job ships: packages found without importing them, excludes, the size check,
and when an installed prefect-ml is used instead (the real cluster runs in
tests/e2e/test_cluster.py)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import pytest

from prefect_ml.integrations import compute
from prefect_ml.integrations.errors import ConfigurationError, EnvironmentCheckError
from prefect_ml.integrations.settings import PrefectMLSettings


@pytest.fixture
def user_project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A user package ``acme`` on the driver's path, with a cache folder that is not shipped."""
    package = tmp_path / "src" / "acme"
    (package / "models").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "models" / "__init__.py").write_text("def build(): ...\n" * 100)
    (package / "__pycache__").mkdir()
    (package / "__pycache__" / "big.cpython-311.pyc").write_bytes(b"x" * 50_000)
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    return package


def _settings(**values: Any) -> PrefectMLSettings:
    return PrefectMLSettings(ray_address="127.0.0.1:6379", **values)


def test_prefect_ml_and_the_allowed_modules_packages_are_shipped_without_caches(
    user_project: Path,
) -> None:
    plan = compute.plan_code(_settings(allowed_modules="acme.models,acme"))

    assert plan.project.name == "prefect_ml" and plan.project.path.name == "prefect_ml"
    assert not plan.project_is_release, "this checkout is an editable install"
    (acme,) = plan.user
    assert (acme.name, acme.path) == ("acme", user_project)
    source = sum(p.stat().st_size for p in user_project.rglob("*.py"))
    assert acme.size_bytes == source, "the __pycache__ folder is not counted (nor shipped)"
    env = plan.runtime_env(ship_project=True)
    assert env["py_modules"] == [str(plan.project.path), str(user_project)]
    assert "__pycache__" in env["excludes"] and "*.pyc" in env["excludes"]
    assert plan.runtime_env(ship_project=False)["py_modules"] == [str(user_project)]
    assert "acme" not in sys.modules, "found, not imported"
    assert plan.describe(ship_project=True).startswith("shipped prefect_ml (")


def test_installed_user_modules_are_left_to_the_nodes_and_missing_ones_refused(
    user_project: Path,
) -> None:
    plan = compute.plan_code(_settings(allowed_modules="acme,yaml"))
    assert plan.installed_user == ("yaml",) and [p.name for p in plan.user] == ["acme"]
    assert "installed user modules yaml" in plan.describe(ship_project=True)

    with pytest.raises(ConfigurationError) as refused:
        compute.plan_code(_settings(allowed_modules="no_such_project.models"))
    assert refused.value.field == "PREFECT_ML_ALLOWED_MODULES"
    assert "'no_such_project'" in refused.value.message


def test_a_package_over_the_limit_is_refused_before_connecting(user_project: Path) -> None:
    (user_project / "weights.bin").write_bytes(b"\0" * 2_000_000)

    with pytest.raises(ConfigurationError) as refused:
        compute.plan_code(_settings(allowed_modules="acme", max_shipped_mb=1))

    assert refused.value.field == "PREFECT_ML_MAX_SHIPPED_MB"
    assert "acme" in refused.value.message and "2.0 MB" in refused.value.message


def _node(ip: str, version: str | None, importable: bool) -> dict[str, Any]:
    return {
        "ip": ip,
        "versions": {"prefect-ml": version},
        "prefect_ml_from": "/site-packages/prefect_ml" if importable else None,
    }


def test_an_installed_release_is_used_only_when_every_node_has_it() -> None:
    checkout = compute.plan_code(_settings())
    release = dataclasses.replace(checkout, project_is_release=True)
    same = [_node("10.0.0.2", "1.2.0", True), _node("10.0.0.3", "1.2.0", True)]
    one_old = [_node("10.0.0.2", "1.2.0", True), _node("10.0.0.3", "1.1.0", True)]
    listed_only = [_node("10.0.0.2", "1.2.0", False)]

    assert compute.needs_probe("auto", release) and not compute.needs_probe("auto", checkout)
    assert compute.decide_shipping("auto", checkout, "1.2.0", same), "a checkout ships"
    assert not compute.decide_shipping("auto", release, "1.2.0", same)
    assert compute.decide_shipping("auto", release, "1.2.0", one_old)
    assert compute.decide_shipping("always", release, "1.2.0", same)
    assert not compute.decide_shipping("never", release, "1.2.0", same)

    with pytest.raises(EnvironmentCheckError) as refused:
        compute.decide_shipping("never", release, "1.2.0", one_old + listed_only)
    message = str(refused.value)
    assert "10.0.0.3 (1.1.0)" in message and "10.0.0.2 (1.2.0 listed, not importable)" in message
    assert "PREFECT_ML_SHIP_CODE=auto" in message
