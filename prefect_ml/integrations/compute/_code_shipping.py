"""What the workers of a Ray cluster import: prefect-ml and the user's modules, shipped with the
job (Ray's ``runtime_env`` ``py_modules``) unless the nodes have them installed.

A worker on another host has neither this checkout nor the user's project folder. The package
``prefect_ml`` and the top-level packages of ``PREFECT_ML_ALLOWED_MODULES`` (the only user
code a parameter may name, :mod:`integrations.plugins`) are zipped, uploaded to the cluster once
per content (Ray caches them by hash) and put on every worker's path. Modules that this Python
imports from its site-packages are installed ones: the nodes need them installed too.

``PREFECT_ML_SHIP_CODE`` chooses for prefect-ml itself: ``always``; ``never`` (every node must
have it installed, checked by a probe on each node); ``auto``, which ships a source checkout
(its code may differ from any release) and uses an installed release when every node has the
same version.
"""

from __future__ import annotations

import importlib.util
import sysconfig
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect_ml.integrations.compute._worker_setup import ExpectedCode, content_hash, package_files
from prefect_ml.integrations.errors import ConfigurationError, EnvironmentCheckError
from prefect_ml.integrations.settings import PrefectMLSettings

# Never shipped (Ray's gitignore-style patterns, also applied when measuring).
EXCLUDES = (
    "__pycache__",
    "*.pyc",
    "*.egg-info",
    ".git",
    ".mypy_cache",
    ".pytest_cache",
    ".ruff_cache",
    ".ipynb_checkpoints",
)
MB = 10**6


@dataclass(frozen=True)
class Package:
    """One top-level package (or module) to ship: its import name, folder and size."""

    name: str
    path: Path
    size_bytes: int


@dataclass(frozen=True)
class CodePlan:
    """What a cluster job ships: prefect-ml, the user's source packages, and the user's
    installed modules that the nodes must have."""

    project: Package
    project_is_release: bool  # imported from site-packages, not from a source checkout
    user: tuple[Package, ...]
    installed_user: tuple[str, ...]

    def runtime_env(self, *, ship_project: bool) -> dict[str, Any]:
        """The ``py_modules`` part of the job's runtime_env ({} when nothing is shipped)."""
        packages = [*([self.project] if ship_project else []), *self.user]
        if not packages:
            return {}
        return {"py_modules": [str(p.path) for p in packages], "excludes": list(EXCLUDES)}

    def expected_code(self, *, ship_project: bool, version: str) -> ExpectedCode:
        """What the job's workers must import (:func:`worker_setup.use_shipped_code`): each
        shipped package from its shipped folder, prefect-ml checked by its content hash; an
        installed prefect-ml (``version`` on the driver) from the nodes' site-packages."""
        shipped = [*([self.project] if ship_project else []), *self.user]
        return ExpectedCode(
            shipped=[package.name for package in shipped],
            installed=[] if ship_project else [self.project.name],
            project_hash=content_hash(self.project.path, EXCLUDES) if ship_project else None,
            project_version=version,
            excludes=list(EXCLUDES),
        )

    def describe(self, *, ship_project: bool) -> str:
        """For logs and tags: ``shipped prefect_ml (0.6 MB), my_models (0.01 MB)``."""
        shipped = [*([self.project] if ship_project else []), *self.user]
        parts = [f"{p.name} ({p.size_bytes / MB:.2f} MB)" for p in shipped]
        text = f"shipped {', '.join(parts)}" if parts else "nothing shipped"
        if not ship_project:
            text += "; prefect-ml installed on the nodes"
        if self.installed_user:
            text += f"; installed user modules {', '.join(self.installed_user)}"
        return text


def package_size(path: Path) -> int:
    """Bytes Ray uploads for ``path``: its files, links followed, excludes left out."""
    if path.is_file():
        return path.stat().st_size
    return sum(file.stat().st_size for _, file in package_files(path, EXCLUDES))


def _installed_roots() -> tuple[Path, ...]:
    paths = sysconfig.get_paths()
    return tuple(Path(paths[key]).resolve() for key in ("purelib", "platlib", "stdlib"))


def _is_installed(path: Path) -> bool:
    resolved = path.resolve()
    return any(resolved.is_relative_to(root) for root in _installed_roots())


def _top_level(name: str) -> Path | None:
    """The folder (or file) of top-level package ``name`` as this Python finds it, without
    importing it; None when it is not importable here."""
    spec = importlib.util.find_spec(name)
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(spec.origin) if spec.origin else None


def _package(name: str, path: Path, limit_bytes: float) -> Package:
    size = package_size(path)
    if size > limit_bytes:
        raise ConfigurationError(
            "PREFECT_ML_MAX_SHIPPED_MB",
            f"{name} ({path}) is {size / MB:.1f} MB, more than the {limit_bytes / MB:g} MB "
            "shipped to a cluster at most; move data and build outputs out of the package, "
            "install it on the nodes instead, or raise PREFECT_ML_MAX_SHIPPED_MB",
        )
    return Package(name, path, size)


def plan_code(settings: PrefectMLSettings) -> CodePlan:
    """What a job on ``settings.ray_address`` ships; raises before connecting when a package is
    too big or an allowed module cannot be found here."""
    limit = settings.max_shipped_mb * MB
    project_path = _top_level("prefect_ml")
    assert project_path is not None  # this module is part of it
    user: list[Package] = []
    installed: list[str] = []
    for name in _top_levels(settings.allowed_module_prefixes):
        path = _top_level(name)
        if path is None:
            raise ConfigurationError(
                "PREFECT_ML_ALLOWED_MODULES",
                f"module {name!r} is allowed but not importable here, so it cannot be shipped "
                "to the cluster; add its folder to PYTHONPATH or install it",
            )
        if _is_installed(path):
            installed.append(name)
        elif name != "prefect_ml":
            user.append(_package(name, path, limit))
    return CodePlan(
        project=_package("prefect_ml", project_path, limit),
        project_is_release=_is_installed(project_path),
        user=tuple(user),
        installed_user=tuple(installed),
    )


def _top_levels(prefixes: Iterable[str]) -> list[str]:
    return sorted({prefix.split(".")[0] for prefix in prefixes})


def needs_probe(mode: str, plan: CodePlan) -> bool:
    """Whether the nodes' installed prefect-ml must be looked at before deciding."""
    return mode == "never" or (mode == "auto" and plan.project_is_release)


def decide_shipping(
    mode: str, plan: CodePlan, driver_version: str, nodes: Sequence[dict[str, Any]]
) -> bool:
    """Whether to ship prefect-ml, from the nodes' probes (:func:`node_probe.code_on_node`,
    run without shipping it). ``never`` with a node that lacks this version is an error naming
    the nodes, since their workers would fail to import the project or run other code."""
    if mode == "always" or (mode == "auto" and not plan.project_is_release):
        return True
    differing = [
        f"{node['ip']} ({_installed_version(node)})"
        for node in nodes
        if node["prefect_ml_from"] is None or node["versions"].get("prefect-ml") != driver_version
    ]
    if not differing:
        return False
    if mode == "auto":
        return True
    raise EnvironmentCheckError(
        f"PREFECT_ML_SHIP_CODE=never, but nodes {', '.join(differing)} do not have prefect-ml "
        f"{driver_version} installed; install it in the cluster's image or set "
        "PREFECT_ML_SHIP_CODE=auto to ship it with each job"
    )


def _installed_version(node: dict[str, Any]) -> str:
    version = node["versions"].get("prefect-ml")
    if node["prefect_ml_from"] is None:
        return f"{version} listed, not importable" if version else "not installed"
    return str(version)
