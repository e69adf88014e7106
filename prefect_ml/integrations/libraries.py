"""The heavy libraries prefect-ml is built on, imported on first use, and what to install when
one is missing.

Importing the flows (``prefect-ml --help``, Prefect loading a deployment's entrypoint) must not
pay for Ray, Ray Serve, Optuna, torch or MLflow (seconds each). The one module that owns such a
library names it once, at its top, and uses it as if it were imported::

    if TYPE_CHECKING:
        import optuna
    else:
        optuna = lazy_import("optuna")

    def open_study(...):
        return optuna.create_study(...)  # optuna is imported here, the first time

A package whose private modules own such libraries loads its public names the same way
(:func:`lazy_exports`): its ``__init__`` maps each name to the module that defines it.

A library that cannot be imported raises :class:`ModuleNotFoundError` at that first use, with
the pip command that installs it: ``pip install 'prefect-ml[<extra>]'`` for a library of one of
prefect-ml's extras (``pyproject.toml``), ``pip install prefect-ml`` for one of its dependencies.
A library that is cheap, or that every process of a run imports anyway (numpy, pydantic,
Prefect), stays a plain ``import``.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Mapping
from importlib import metadata
from types import ModuleType
from typing import Any

DISTRIBUTION = "prefect-ml"


def lazy_import(name: str) -> Any:
    """The module ``name``, imported on its first attribute access (see the module's docstring).

    Typed ``Any``: declare the name under ``TYPE_CHECKING`` as well, for type checkers.
    """
    return _LazyModule(name)


def lazy_exports(
    package: str, exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package face's ``__getattr__`` and ``__dir__`` (PEP 562): each public name in
    ``exports`` (name -> the private module of ``package`` that defines it) is imported on its
    first access, then kept on the package, so the next access skips the hook.

    Declare the names under ``TYPE_CHECKING`` as well, for type checkers.
    """

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{exports[name]}"), name)
        setattr(importlib.import_module(package), name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(exports)

    return __getattr__, __dir__


class _LazyModule:
    def __init__(self, name: str) -> None:
        self._name = name
        self._module: ModuleType | None = None

    def __getattr__(self, attribute: str) -> Any:
        if self._module is None:
            self._module = _import(self._name)
        return getattr(self._module, attribute)

    def __repr__(self) -> str:
        state = "imported" if self._module else "imported on first use"
        return f"<module {self._name!r}, {state}>"


def _import(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        missing = exc.name or name
        if not f"{name}.".startswith(f"{missing}."):
            raise  # the library is there; one of its own dependencies is not
        raise ModuleNotFoundError(
            f"prefect-ml needs {missing!r} here, and it is not installed: {install_hint(missing)}",
            name=missing,
        ) from exc


def installed_version() -> str:
    """The version of prefect-ml installed here (``0+unknown`` for a checkout that is not
    installed): ``prefect_ml.__version__``, and what a node reports, read without importing
    the package's public face."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:  # a checkout that is not installed
        return "0+unknown"


def install_hint(library: str) -> str:
    """The pip command that installs ``library`` (an import name) as prefect-ml declares it:
    with prefect-ml's own dependencies, or with the extra that lists it."""
    try:
        requirements = metadata.requires(DISTRIBUTION) or []
    except metadata.PackageNotFoundError:  # a checkout that is not installed
        requirements = []
    extras = set()
    for requirement in requirements:
        declared = re.match(r"[A-Za-z0-9._-]+", requirement)
        if declared is None or _normalized(declared[0]) != _normalized(library):
            continue
        extra = re.search(r"""extra\s*==\s*["']([^"']+)["']""", requirement)
        if extra is None:
            return f"pip install {DISTRIBUTION}"
        extras.add(extra[1])
    return (
        f"pip install '{DISTRIBUTION}[{min(extras)}]'" if extras else f"pip install {DISTRIBUTION}"
    )


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()
