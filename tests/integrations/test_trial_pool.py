"""The trial pool on a real (local) Ray: its workers start as it is made, before it is entered
(the caller's set-up meanwhile); its first workers on a busy cluster (those placed
within the timeout run, none placed is an error, and the wait is said); the replacement of a
lost worker (one that dies with the node it landed on is tried again; one the cluster has no
room for closes its slot)."""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from typing import Any

import pytest

from prefect_ml.integrations.campaign import RayTrialPool, TrialError, TrialWorker, _trial_pool
from prefect_ml.integrations.config.resources import Resources
from prefect_ml.integrations.errors import TrainingCodeError
from tests.helpers import holding_cpus, wait_for

pytestmark = pytest.mark.usefixtures("ray_cluster")

ONE_CPU = Resources(cpus=1)


class FirstReplacementDies(RayTrialPool):
    """The first replacement lands on a node that dies under it (Ray has not yet declared the
    node dead, so it still counts as room): its actor dies before it is ready."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.doomed = 0  # the pool's first workers start
        super().__init__(*args, **kwargs)
        self.doomed = 1  # its first replacement dies

    def _start(self, count: int, timeout: float) -> list[Any]:
        import ray

        if self.doomed:
            self.doomed -= 1
            doomed = ray.remote(TrialWorker).options(num_cpus=1, max_restarts=0).remote()
            ray.kill(doomed)
            ray.get(doomed.ready.remote(1))  # raises RayActorError, as a dying node's actor does
        return super()._start(count, timeout)


def test_a_replacement_that_dies_with_its_node_is_started_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_trial_pool, "REPLACEMENT_RETRY_S", 0.1)
    with FirstReplacementDies(1, request=ONE_CPU, driver_only=False, start_timeout_s=120) as pool:
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

    monkeypatch.setattr(_trial_pool, "REPLACEMENT_WAIT_S", 3.0)
    holder = ray.remote(TrialWorker).options(**ONE_CPU.actor_options(), max_restarts=0)
    with RayTrialPool(2, request=ONE_CPU, driver_only=False, start_timeout_s=120) as pool:
        ray.kill(pool._workers[0])  # the lost worker
        squatter = holder.remote()
        try:
            ray.get(squatter.ready.remote(1), timeout=60)  # it holds the freed CPU now
            assert not pool.replace(0), "no room within the wait: the slot closes"
            pool.finish()  # the open slot answers; the closed one is skipped
        finally:
            ray.kill(squatter)


class TimedFromTheFirstStart(RayTrialPool):
    """Its start timeout counts from its first worker's start, not from the asking: on a loaded
    machine (two test sessions side by side, load 8-27) the start of the one worker Ray can
    place (a process, torch's import) outlasted the 8 s the test gave the whole pool. The wait
    for that start is bounded."""

    def _ask(self, count: int) -> _trial_pool._Asked:
        import ray

        asked = super()._ask(count)
        first, _ = ray.wait(list(asked.waiting), num_returns=1, timeout=120)
        assert first, "no trial worker started within 120 s, with a CPU free for one"
        return dataclasses.replace(asked, began=time.monotonic())


def test_a_busy_cluster_runs_the_workers_placed_within_the_timeout_and_says_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Other work holds one of the session Ray's 2 CPUs: of 2 workers one starts; the pool
    says what the other waits for and, at the timeout, that it runs with one."""
    import ray

    monkeypatch.setattr(_trial_pool, "PLACEMENT_NOTICE_S", 1.0)
    logger = logging.getLogger("test.trial_pool")
    node = ray.util.get_node_ip_address()
    with caplog.at_level(logging.WARNING, logger.name), holding_cpus(1):
        with TimedFromTheFirstStart(
            2, request=ONE_CPU, driver_only=False, start_timeout_s=4, logger=logger
        ) as pool:
            assert pool.size == 1
            pool.finish()  # the started worker answers
    waiting, running = (r.getMessage() for r in caplog.records)  # one notice: repeats are 30 s
    # The notice comes after the first 1 s wait on the other, the placed worker started.
    assert re.match(r"Ray has started 1 of 2 trial worker\(s\) after \d+ s: ", waiting)
    assert f"2 trial(s) x (1 CPU) asked; free now: node {node}: 0 of 2 CPU" in waiting
    assert running.startswith("Running 1 trial(s) at a time, not 2")
    assert "within 4 s (PREFECT_ML_WORKER_GROUP_START_TIMEOUT_S)" in running


def test_a_pool_ray_cannot_place_at_all_ends_at_its_timeout_and_leaves_nothing_pending() -> None:
    """Both CPUs held: no worker starts; the pool ends at its timeout with the request, each
    node's free resources and the fixes, and its pending actors are gone (they would take the
    CPUs once free, for a campaign that has ended)."""
    import ray

    started = time.monotonic()
    with holding_cpus(2), pytest.raises(TrainingCodeError) as ended:
        with RayTrialPool(2, request=ONE_CPU, driver_only=False, start_timeout_s=4):
            pass
    assert time.monotonic() - started < 60
    message = str(ended.value)
    node = ray.util.get_node_ip_address()
    for reason in (
        "no trial worker of the campaign started within 4 s",
        f"2 trial(s) x (1 CPU) asked; free now: node {node}: 0 of 2 CPU",
        "--concurrency",
        "raise PREFECT_ML_WORKER_GROUP_START_TIMEOUT_S",
    ):
        assert reason in message, reason
    wait_for(lambda: ray.available_resources().get("CPU") == 2, 60, "both CPUs free again")


def test_the_workers_start_as_the_pool_is_made_and_close_without_being_entered() -> None:
    """The campaign opens its MLflow runs while its workers start: they are ready before anyone
    enters the pool, which then has them at once; a pool the caller never enters (its set-up
    failed meanwhile) leaves nothing when closed. One wait hands back every call that has
    finished (slots whose trials end together), not only the first."""
    import ray

    pool = RayTrialPool(2, request=ONE_CPU, driver_only=False, start_timeout_s=120)
    try:
        assert pool._asked is not None
        asked = list(pool._asked.waiting)
        ready, _ = ray.wait(asked, num_returns=2, timeout=120)  # nobody waits on the pool
        assert len(ready) == 2, "the workers asked for started before the pool was entered"
        with pool:
            assert pool.size == 2
            pool.advance(0)  # no trial begun: each call fails at once
            pool.advance(1)
            pool.finish()  # a worker runs its calls in order: both advances have returned
            outcomes = pool.wait(60)
            assert sorted(slot for slot, _ in outcomes) == [0, 1]
            assert all(isinstance(outcome, TrialError) for _, outcome in outcomes)
            assert "no trial started" in outcomes[0][1].error
    finally:
        pool.close()
    unentered = RayTrialPool(2, request=ONE_CPU, driver_only=False, start_timeout_s=120)
    assert unentered._asked is not None
    workers = list(unentered._asked.waiting.values())
    unentered.close()
    for worker in workers:  # killed: a call on it fails instead of waiting for a CPU
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(worker.finish.remote(), timeout=60)
