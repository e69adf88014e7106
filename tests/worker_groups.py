"""Which tests one pytest-xdist worker runs together (`make test-all`, ``--dist loadgroup``).

A test file runs on one worker, so its module fixtures (a served model, `prefect-ml ui`) are
built once; the files on the session's 3-node cluster (:data:`CLUSTER_FILES`) run on one
worker, so the machine runs one such cluster at a time; and the files of
:data:`NEVER_SIDE_BY_SIDE` run on one worker, one after the other.

The group is worked out from the test's id by the controller's scheduler
(:class:`FileGroupScheduling`), not from ``xdist_group`` marks: pytest-xdist 3.8 passes a mark's
group by appending it to ``item._nodeid``, which pytest 9 no longer reads (an item's id is
``item._id``), so under pytest 9.2 every test was its own group and a file's tests ran on both
workers (pytest-dev/pytest-xdist#1386).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

CLUSTER_GROUP = "cluster"
# The test files whose tests use the session's 3-node cluster (the ``cluster`` fixture).
CLUSTER_FILES = frozenset({"tests/e2e/test_cluster.py", "tests/e2e/test_cluster_doctor.py"})
NEVER_SIDE_BY_SIDE_GROUP = "serving-and-ui"
# Files that one worker runs one after the other, never at once: test_serving's canaries load
# the machine with requests (load 18-36 on 2 cores) while test_prefect_ui's deployment runs each
# start a local Ray, whose node Ray gives a fixed 30 s to register: beside them it failed to, in
# two full tiers of three (2026-12-08).
NEVER_SIDE_BY_SIDE = frozenset({"tests/e2e/test_serving.py", "tests/e2e/test_prefect_ui.py"})


_SHARED_GROUPS = {
    **dict.fromkeys(CLUSTER_FILES, CLUSTER_GROUP),
    **dict.fromkeys(NEVER_SIDE_BY_SIDE, NEVER_SIDE_BY_SIDE_GROUP),
}


def group_of(nodeid: str) -> str:
    """The worker group of the test ``nodeid``: its file, or the group its file shares (the
    cluster's, or the files never run side by side)."""
    path = nodeid.split("::", 1)[0]
    return _SHARED_GROUPS.get(path, path)


def _on_the_cluster(item: pytest.Item) -> bool:
    """Whether ``item`` uses the session's 3-node cluster (tests/conftest.py's ``cluster``, not
    the chaos runs' fixture of that name)."""
    info = getattr(item, "_fixtureinfo", None)
    definitions = info.name2fixturedefs.get("cluster", ()) if info else ()
    return bool(definitions) and definitions[-1].func.__module__ == "tests.conftest"


def check_cluster_files(items: Sequence[pytest.Item]) -> None:
    """A test on the 3-node cluster lives in one of :data:`CLUSTER_FILES`: else a worker would
    start a second cluster beside the first."""
    stray = sorted(
        {
            item.nodeid.split("::", 1)[0]
            for item in items
            if _on_the_cluster(item) and group_of(item.nodeid) != CLUSTER_GROUP
        }
    )
    if stray:
        raise pytest.UsageError(
            f"{', '.join(stray)} use the 3-node cluster: add them to CLUSTER_FILES in "
            "tests/worker_groups.py, so that one worker runs every test on the cluster"
        )


def make_scheduler(config: pytest.Config, log: Any) -> Any:
    """pytest-xdist's scope scheduler with a scope per worker group (:func:`group_of`); the
    largest groups (by number of tests) are handed out first."""
    from xdist.scheduler import LoadScopeScheduling

    class FileGroupScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    return FileGroupScheduling(config, log)
