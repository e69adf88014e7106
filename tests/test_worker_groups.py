"""`make test-all`'s two workers get whole test files, and every file on the 3-node cluster goes
to one worker, as do the files never run side by side (tests/worker_groups.py), through
pytest-xdist's own scheduler."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests import worker_groups

COLLECTED = [
    "tests/e2e/test_serving.py::test_a",
    "tests/e2e/test_serving.py::test_b[x]",
    "tests/e2e/test_serving.py::test_b[y@z]",
    "tests/e2e/test_cluster.py::test_a",
    "tests/e2e/test_prefect_ui.py::test_a",
    "tests/e2e/test_cluster_doctor.py::test_a",
    "tests/e2e/test_prefect_ui.py::test_b",
    "tests/e2e/test_cluster.py::test_b",
    "tests/e2e/test_fail_fast.py::test_a",
    "tests/e2e/test_fail_fast.py::test_b",
]


class Worker:
    """What the scheduler drives of a worker: its name and the tests it is sent."""

    def __init__(self, name: str) -> None:
        self.gateway = SimpleNamespace(id=name)
        self.sent: list[str] = []
        self.shutting_down = False

    def send_runtest_some(self, indices: list[int]) -> None:
        self.sent += [COLLECTED[index] for index in indices]

    def shutdown(self) -> None:
        self.shutting_down = True


def test_a_file_and_the_clusters_files_each_go_to_one_worker(
    pytestconfig: pytest.Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before (xdist's xdist_group marks, lost under pytest 9): every test its own group, a
    file's tests over both workers, the cluster started on both."""
    monkeypatch.setattr(pytestconfig.option, "tx", ["2*popen"])
    monkeypatch.setattr(pytestconfig.option, "dist", "loadgroup")
    scheduler = pytestconfig.hook.pytest_xdist_make_scheduler(config=pytestconfig, log=None)
    workers = [Worker("gw0"), Worker("gw1")]
    for worker in workers:
        scheduler.add_node(worker)
        scheduler.add_node_collection(worker, COLLECTED)
    scheduler.schedule()
    done: set[str] = set()
    while pending := [(w, n) for w in workers for n in w.sent if n not in done]:
        for worker, nodeid in pending:  # a worker that ends its tests is handed the next group
            done.add(nodeid)
            scheduler.mark_test_complete(worker, COLLECTED.index(nodeid))

    ran_on = {nodeid: i for i, worker in enumerate(workers) for nodeid in worker.sent}
    assert sorted(ran_on) == sorted(COLLECTED), "every test sent once"
    for group in ("tests/e2e/test_fail_fast.py", "serving-and-ui", "cluster"):
        members = [n for n in COLLECTED if worker_groups.group_of(n) == group]
        assert len({ran_on[n] for n in members}) == 1, f"{group} split: {ran_on}"
    assert worker_groups.group_of("tests/e2e/test_cluster_doctor.py::test_a") == "cluster"
    # Never at once: the serving file's canaries starved the UI's deployment runs' local Ray.
    assert worker_groups.group_of("tests/e2e/test_serving.py::test_a") == "serving-and-ui"
    assert worker_groups.group_of("tests/e2e/test_prefect_ui.py::test_a") == "serving-and-ui"
