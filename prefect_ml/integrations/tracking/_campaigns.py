"""Campaigns in MLflow: one parent run per campaign, one nested run per trial, written by one
FIFO thread (:class:`TrackingWriter`) so tracking never holds a trial worker idle."""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from prefect_ml.integrations.tracking._runs import finish_run, log_epoch, log_params, set_tags
from prefect_ml.integrations.tracking._tags import (
    CAMPAIGN_PARENT_TAG,
    CAMPAIGN_TAG,
    ERROR_TAG,
    PARENT_TAG,
    TRIAL_STATE_TAG,
    TRIAL_TAG,
)

if TYPE_CHECKING:
    from mlflow import MlflowClient


def campaign_parent_run(
    client: MlflowClient,
    experiment_id: str,
    campaign_key: str,
    known_run_id: str | None,
    *,
    run_name: str,
    params: dict[str, Any],
    tags: dict[str, str],
) -> tuple[str, bool]:
    """The campaign's parent run, re-attached if it exists; returns (run_id, reattached).

    ``known_run_id`` comes from the study; the tag search covers a process killed between
    creating the run and recording its id in the study.
    """
    from mlflow.exceptions import MlflowException

    run_id = None
    if known_run_id:
        try:
            run_id = client.get_run(known_run_id).info.run_id
        except MlflowException:
            run_id = None
    if run_id is None:
        found = client.search_runs(
            [experiment_id],
            filter_string=f"tags.`{CAMPAIGN_PARENT_TAG}` = '{campaign_key}'",
            max_results=1,
        )
        run_id = found[0].info.run_id if found else None
    if run_id is not None:
        client.update_run(run_id, status="RUNNING")
        set_tags(client, run_id, tags)
        return run_id, True
    run = client.create_run(
        experiment_id, run_name=run_name, tags={CAMPAIGN_PARENT_TAG: campaign_key, **tags}
    )
    log_params(client, run.info.run_id, params)
    return run.info.run_id, False


def trial_runs(client: MlflowClient, experiment_id: str, parent_run_id: str) -> dict[int, Any]:
    """The nested trial runs of a campaign by trial number (``RunInfo`` plus tags)."""
    runs = client.search_runs(
        [experiment_id],
        filter_string=f"tags.`{PARENT_TAG}` = '{parent_run_id}'",
        max_results=50000,
    )
    return {int(run.data.tags[TRIAL_TAG]): run for run in runs if run.data.tags.get(TRIAL_TAG)}


def start_trial_run(
    client: MlflowClient,
    experiment_id: str,
    parent_run_id: str,
    campaign_key: str,
    number: int,
    params: dict[str, Any],
) -> str:
    run = client.create_run(
        experiment_id,
        run_name=f"trial-{number}",
        tags={PARENT_TAG: parent_run_id, CAMPAIGN_TAG: campaign_key, TRIAL_TAG: str(number)},
    )
    log_params(client, run.info.run_id, params)
    return str(run.info.run_id)


TRIAL_STATUS = {"COMPLETE": "FINISHED", "PRUNED": "KILLED", "FAIL": "FAILED"}


def end_trial_run(
    client: MlflowClient,
    run_id: str,
    state: str,
    values: dict[str, float],
    error: str | None = None,
) -> None:
    """Record a trial's final state (complete, pruned, failed with its error) and values: one
    batch, then the run's end (a campaign writes this for every trial)."""
    import time

    from mlflow.entities import Metric, RunTag

    tags = {TRIAL_STATE_TAG: state}
    if error:
        tags[ERROR_TAG] = error[:4000]
    now = int(time.time() * 1000)
    client.log_batch(
        run_id,
        metrics=[
            Metric(f"objective.{name}", float(value), now, 0)
            for name, value in values.items()
            if math.isfinite(value)
        ],
        tags=[RunTag(k, v) for k, v in tags.items()],
    )
    if error:
        client.log_text(run_id, error, "error.txt")
    finish_run(client, run_id, TRIAL_STATUS.get(state, "FAILED"))


class TrackingWriter:
    """A campaign's only MLflow writer: one FIFO thread, so tracking never holds a trial worker
    idle. Callers hand it plain values; the trial numbers' run ids are its own state (read
    through :meth:`run_ids`, a copy). A failed write is recorded in :attr:`errors`: the study,
    not MLflow, is the campaign's source of truth."""

    def __init__(
        self, client: MlflowClient, experiment_id: str, parent_run_id: str, campaign_key: str
    ) -> None:
        self.client, self.experiment_id = client, experiment_id
        self.parent_run_id, self.campaign_key = parent_run_id, campaign_key
        self.errors: list[str] = []
        self._run_ids: dict[int, str] = {}
        self._lock = threading.Lock()
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="mlflow-writer", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                job()
            except Exception as exc:  # recorded; the study stays the source of truth
                self.errors.append(repr(exc))

    def run_ids(self) -> dict[int, str]:
        with self._lock:
            return dict(self._run_ids)

    def _run_id(self, number: int) -> str:
        with self._lock:
            return self._run_ids[number]

    def known_run(self, number: int, run_id: str) -> None:
        """A trial's run that already exists (found on resume)."""
        with self._lock:
            self._run_ids[number] = run_id

    def trial_started(self, number: int, params: dict[str, Any]) -> None:
        def start() -> None:
            run_id = start_trial_run(
                self.client,
                self.experiment_id,
                self.parent_run_id,
                self.campaign_key,
                number,
                params,
            )
            self.known_run(number, run_id)

        self._queue.put(start)

    def epoch(
        self,
        number: int,
        epoch: int,
        metrics: dict[str, float],
        checkpoint: str,
        tags: dict[str, str] | None = None,
    ) -> None:
        """A trial's epoch, with ``tags`` for its run in the same write."""
        self._queue.put(
            lambda: log_epoch(self.client, self._run_id(number), epoch, metrics, checkpoint, tags)
        )

    def trial_ended(
        self, number: int, state: str, values: dict[str, float], error: str | None
    ) -> None:
        self._queue.put(
            lambda: end_trial_run(self.client, self._run_id(number), state, values, error)
        )

    def close(self) -> None:
        """Write everything queued, then stop the thread."""
        self._queue.put(None)
        self._thread.join()
