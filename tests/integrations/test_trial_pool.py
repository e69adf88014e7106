"""The trial pool's replacement of a lost worker on a real (local) Ray: a replacement that dies
with the node it landed on is tried again; one the cluster has no room for closes its slot."""

from __future__ import annotations

from typing import Any

import pytest

from prefect_ml.integrations import trial_pool
from prefect_ml.integrations.resources import ResourceRequest
from prefect_ml.integrations.trial_pool import RayTrialPool
from prefect_ml.integrations.trial_worker import TrialWorker

pytestmark = pytest.mark.usefixtures("ray_cluster")


class FirstReplacementDies(RayTrialPool):
    """The first replacement lands on a node that dies under it (Ray has not yet declared the
    node dead, so it still counts as room): its actor dies before it is ready."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.doomed = 1
        super().__init__(*args, **kwargs)

    def _start(self, count: int, timeout: float | None = None) -> list[Any]:
        import ray

        if timeout is not None and self.doomed:  # a replacement, not the pool's first workers
            self.doomed -= 1
            doomed = ray.remote(TrialWorker).options(num_cpus=1, max_restarts=0).remote()
            ray.kill(doomed)
            ray.get(doomed.ready.remote(1))  # raises RayActorError, as a dying node's actor does
        return super()._start(count, timeout)


def test_a_replacement_that_dies_with_its_node_is_started_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(trial_pool, "REPLACEMENT_RETRY_S", 0.1)
    with FirstReplacementDies(1, request=ResourceRequest(cpus=1), driver_only=False) as pool:
        assert pool.replace(0), "the second attempt got a worker"
        assert pool.doomed == 0
        pool.finish()  # the new worker answers


def test_a_replacement_the_cluster_has_no_room_for_closes_its_slot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two workers fill the session Ray's 2 CPUs; one dies and another actor takes its CPU
    before the pool replaces it: the replacement cannot be placed within the wait, the slot
    closes, and the open slot goes on."""
    import ray

    monkeypatch.setattr(trial_pool, "REPLACEMENT_WAIT_S", 3.0)
    request = ResourceRequest(cpus=1)
    holder = ray.remote(TrialWorker).options(**request.actor_options(), max_restarts=0)
    with RayTrialPool(2, request=request, driver_only=False) as pool:
        ray.kill(pool._workers[0])  # the lost worker
        squatter = holder.remote()
        try:
            ray.get(squatter.ready.remote(1), timeout=60)  # it holds the freed CPU now
            assert not pool.replace(0), "no room within the wait: the slot closes"
            pool.finish()  # the open slot answers; the closed one is skipped
        finally:
            ray.kill(squatter)
