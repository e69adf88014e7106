"""Which user code a parameter may name: registered plug-ins and allowed modules, nothing else.

Flow parameters arrive from the CLI, but also from the Prefect UI form and API, so a
``module:function`` parameter is untrusted input: importing and calling it runs code. A dataset,
a model or a campaign's search space may come from

* a plug-in: an entry point in the group ``prefect_ml.datasets``, ``prefect_ml.models`` or
  ``prefect_ml.search_spaces`` of an installed package, named by its entry-point name
  (``dataset="wine"``) or by its value;
* a module under one of the prefixes of ``PREFECT_ML_ALLOWED_MODULES`` (``my_project``), and
  defined there: a function the module merely imports (``my_project.data:system``) is refused.

The check reads only strings; nothing is imported before it passes.
"""

from __future__ import annotations

import functools
import os
import re
import sys
from importlib import metadata

from prefect_ml.integrations.errors import ConfigurationError
from prefect_ml.integrations.settings import get_settings

DATASET_GROUP = "prefect_ml.datasets"
MODEL_GROUP = "prefect_ml.models"
SEARCH_SPACE_GROUP = "prefect_ml.search_spaces"
_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_ATTRIBUTE = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$|^_[A-Za-z0-9][A-Za-z0-9_]*$")


def registered(group: str) -> dict[str, str]:
    """Entry-point name to ``module:attribute`` for the plug-ins installed in ``group``.

    Reading every installed package's metadata takes about 13 ms here, and a warm trial worker
    resolves its model (three reads) for every trial, so the answer is kept while ``sys.path``
    and the modification times of its folders are unchanged: installing or removing a package
    adds or removes its ``.dist-info`` folder there.
    """
    return dict(_entry_points(group, _path_state()))


def _path_state() -> tuple[tuple[str, int], ...]:
    """Each ``sys.path`` entry (absolute) with its modification time (-1: it does not exist)."""

    def mtime(path: str) -> int:
        try:
            return os.stat(path).st_mtime_ns
        except OSError:
            return -1

    paths = [os.path.abspath(entry) for entry in sys.path]
    return tuple((path, mtime(path)) for path in paths)


@functools.lru_cache(maxsize=8)
def _entry_points(group: str, path_state: tuple[tuple[str, int], ...]) -> dict[str, str]:
    """``group``'s entry points installed at ``path_state`` (the cache's key)."""
    return {entry.name: entry.value for entry in metadata.entry_points(group=group)}


def under_prefix(module_name: str, prefixes: tuple[str, ...]) -> bool:
    """Whether ``module_name`` is one of ``prefixes`` or inside one of them."""
    return any(module_name == p or module_name.startswith(f"{p}.") for p in prefixes)


def check_allowed(path: str, *, group: str, field: str) -> tuple[str, str]:
    """``(module, attribute)`` of ``path`` if it may be imported; a :class:`ConfigurationError`
    naming ``field`` and both ways to allow it otherwise."""
    module_name, _, attribute = path.partition(":")
    if not _MODULE.match(module_name) or not _ATTRIBUTE.match(attribute):
        raise ConfigurationError(
            field, f"{path!r} is not an import path; write it as 'package.module:function'"
        )
    if path in registered(group).values():
        return module_name, attribute
    prefixes = get_settings().allowed_module_prefixes
    if under_prefix(module_name, prefixes):
        return module_name, attribute
    top = module_name.split(".")[0]
    raise ConfigurationError(
        field,
        f"{path!r} is not allowed: module {module_name!r} is neither under "
        f"PREFECT_ML_ALLOWED_MODULES ({','.join(prefixes) or 'unset'}) nor a registered "
        f"{group!r} entry point. If you trust it, set PREFECT_ML_ALLOWED_MODULES={top} "
        f"(comma-separated module prefixes) where the flow runs, or register it as an entry "
        f"point in the {group!r} group of your package",
    )


def check_defined_in_allowed_module(
    path: str, defined_in: str | None, *, group: str, field: str
) -> None:
    """Refuse a target that an allowed module only imports from elsewhere (``from os import
    system``): the allow-list names code, not every name that code can reach. Plug-ins are
    trusted as their package declares them."""
    if path in registered(group).values():
        return
    prefixes = get_settings().allowed_module_prefixes
    if defined_in is None or not under_prefix(defined_in, prefixes):
        raise ConfigurationError(
            field,
            f"{path!r} is defined in {defined_in!r}, not in an allowed module; point the import "
            "path at a function defined in your own module",
        )
