"""What every Ray worker process of a prefect-ml job runs first (the job's runtime_env
``worker_process_setup_hook``): it points Ray's address lookups at the worker's own cluster and
makes the worker import exactly the code the driver shipped, or refuse to run.

Ray runs the hook before it puts the driver's working directory and script folder
(``JobConfig._py_driver_sys_path``) at the front of the worker's ``sys.path``, ahead of the
``py_modules`` it shipped: a node that has a ``prefect_ml`` folder at the driver's path (an older
or partial copy of the project on a shared filesystem) would import that one. The hook therefore
pins each shipped top-level package to its shipped folder with a finder ahead of ``sys.path``,
and checks that the pinned ``prefect_ml`` has the content hash the driver computed. A worker
whose copy differs refuses to import it: every import of ``prefect_ml`` there raises
:class:`CodeMismatchError`, an ImportError, so whatever the worker was to run (a training
function, a trial, a probe) fails with the reason, as an import error that the next attempt
meets again (Ray Train ends the run on it, :mod:`integrations.training`). Raising from the
hook instead kills the worker process, and Ray reports only that it died.

The hook travels by value, so nodes that cannot import prefect-ml run it: this module imports
nothing of the project.
"""

from __future__ import annotations

import fnmatch
import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import sysconfig
from collections.abc import Iterable, Sequence
from importlib import metadata
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType
from typing import Any, TypedDict


class ExpectedCode(TypedDict):
    """What the driver ships to a cluster job's workers, and what they must import."""

    shipped: list[str]  # top-level packages shipped in py_modules
    installed: list[str]  # top-level packages the nodes must import from their site-packages
    project_hash: str | None  # content_hash of the shipped prefect_ml; None when not shipped
    project_version: str  # the driver's prefect-ml version, for messages
    excludes: list[str]  # what was not shipped (code_shipping.EXCLUDES), left out of the hash


class CodeMismatchError(ImportError):
    """A worker would import other prefect-ml code than the driver shipped."""


def setup_hook(expected: ExpectedCode | None = None) -> dict[str, Any]:
    """The runtime_env entry that runs :func:`find_own_cluster` first in every worker process
    of a job, then :func:`use_shipped_code` when the job ships code (``expected``). The hook
    travels by value, with ``expected``, so nodes that cannot import prefect-ml run it."""
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])

    def prepare_worker() -> None:
        find_own_cluster()
        if expected is not None:
            use_shipped_code(expected)

    return {"worker_process_setup_hook": prepare_worker}


def find_own_cluster() -> None:
    """Point Ray's own address lookups in this worker at the cluster the worker belongs to.

    Ray Train's placement-group cleaner (one per fit) and its state actor call Ray's state API
    without an address; in a worker that means ``RAY_ADDRESS``, else the newest cluster that
    ``ray start`` recorded on the machine (``/tmp/ray/ray_current_cluster``). On a machine that
    runs another Ray, or once ran one, that is another cluster or a dead one: every lookup then
    waits for a GCS that never answers, and each training's end waited about 12 s more for the
    cleaner to stop (measured: 14.6-15.5 s from the last report to ``fit()`` returning, against
    3.5-3.8 s with this hook); against a live other cluster, the cleaner watched the wrong one.
    """
    import ray

    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address


def use_shipped_code(expected: ExpectedCode) -> None:
    """Pin the job's packages to where they must come from (the shipped folders, or the node's
    site-packages for an installed prefect-ml); when the ``prefect_ml`` found is not the
    shipped one, say why on the worker's stderr (which Ray forwards to the driver) and refuse
    every import of it."""
    folders = {name: [shipped_folder(name)] for name in expected["shipped"]}
    folders.update({name: site_packages() for name in expected["installed"]})
    finder = PinnedFinder(folders)
    sys.meta_path.insert(0, finder)
    if expected["project_hash"] is not None:
        difference = project_difference(expected)
        if difference is not None:
            sys.stderr.write(f"prefect-ml: {difference}\n")
            finder.refused["prefect_ml"] = difference


def shipped_folder(name: str) -> str:
    """The folder that Ray's runtime_env put package ``name`` in: the first ``PYTHONPATH``
    entry that holds it (Ray puts the ``py_modules`` folders first)."""
    for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        if entry and (Path(entry, name).is_dir() or Path(entry, f"{name}.py").is_file()):
            return entry
    raise CodeMismatchError(
        f"{name} was shipped with the job but is not on the PYTHONPATH that Ray gave worker "
        f"{os.getpid()} on node {_node()}: {os.environ.get('PYTHONPATH')!r}",
        name=name,
    )


def site_packages() -> list[str]:
    """Where this Python's installed packages are."""
    paths = sysconfig.get_paths()
    return sorted({paths["purelib"], paths["platlib"]})


class PinnedFinder(importlib.abc.MetaPathFinder):
    """Finds each pinned top-level package only in its folders, whatever ``sys.path`` says;
    its submodules follow from the package's ``__path__``. A refused package is not imported
    at all: :class:`CodeMismatchError` with the reason."""

    def __init__(self, folders: dict[str, list[str]]) -> None:
        self.folders = folders
        self.refused: dict[str, str] = {}

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname in self.refused:
            raise CodeMismatchError(self.refused[fullname], name=fullname)
        folders = self.folders.get(fullname)
        if folders is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, folders)
        if spec is None:
            raise ModuleNotFoundError(
                f"No module named {fullname!r} in {', '.join(folders)} on node {_node()}, "
                "where the job expects it",
                name=fullname,
            )
        return spec


def project_difference(expected: ExpectedCode) -> str | None:
    """None when the ``prefect_ml`` this worker imports has the content hash of the copy the
    driver shipped; else why not, naming both versions and hashes, the node, the worker, the
    folder found and the fix."""
    spec = importlib.util.find_spec("prefect_ml")
    folder = next(iter(spec.submodule_search_locations or []), None) if spec else None
    found = content_hash(Path(folder), expected["excludes"]) if folder else None
    if found == expected["project_hash"]:
        return None
    return mismatch_message(
        node=_node(),
        worker=os.getpid(),
        folder=folder,
        found=(_installed_version(), found),
        shipped=(expected["project_version"], str(expected["project_hash"])),
    )


def mismatch_message(
    *,
    node: str,
    worker: int,
    folder: str | None,
    found: tuple[str, str | None],
    shipped: tuple[str, str],
) -> str:
    """Why a worker refuses to run, and what to do about it."""
    where = f"prefect_ml from {folder}" if folder else "no prefect_ml"
    found_version, found_hash = found
    return (
        f"worker {worker} on node {node} imports {where} (prefect-ml {found_version}, "
        f"content {(found_hash or 'none')[:12]}), not the prefect-ml {shipped[0]} the driver "
        f"shipped (content {shipped[1][:12]}), so it refuses to run other code. Remove the "
        "other copy from the node's Python path, set PREFECT_ML_SHIP_CODE=always to ship the "
        f"driver's code with each job, or install prefect-ml {shipped[0]} on the nodes"
    )


def content_hash(folder: Path, excludes: Iterable[str]) -> str:
    """sha256 of a package's files (:func:`package_files`, each by its relative path and the
    sha256 of its bytes): the same on the driver's checkout and on the copy Ray unpacked on a
    node."""
    digest = hashlib.sha256()
    for relative, path in sorted(package_files(folder, excludes)):
        digest.update(f"{relative}\0{hashlib.sha256(path.read_bytes()).hexdigest()}\n".encode())
    return digest.hexdigest()


def package_files(folder: Path, excludes: Iterable[str]) -> list[tuple[str, Path]]:
    """(relative path, path) of every file Ray ships of ``folder``: links followed, names
    matching ``excludes`` (Ray's gitignore-style patterns) left out with what is under them."""
    patterns = list(excludes)

    def kept(name: str) -> bool:
        return not any(fnmatch.fnmatch(name, pattern) for pattern in patterns)

    files: list[tuple[str, Path]] = []
    for parent, subfolders, names in os.walk(folder, followlinks=True):
        subfolders[:] = [name for name in subfolders if kept(name)]
        for name in filter(kept, names):
            path = Path(parent, name)
            files.append((path.relative_to(folder).as_posix(), path))
    return files


def _installed_version() -> str:
    try:
        return metadata.version("prefect-ml")
    except metadata.PackageNotFoundError:
        return "not installed"


def _node() -> str:
    import ray

    return str(ray.util.get_node_ip_address())
