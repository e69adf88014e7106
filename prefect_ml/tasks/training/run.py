"""A training run on the driver, from start to end: its MLflow run, the lease that makes this
process its only driver, its checkpoint store, and the Ray Train worker group.

:class:`TrainingRun` wires these parts — the MLflow run (:mod:`integrations.tracking`), the
checkpoints, which are the run's source of truth (:mod:`integrations.training`), the
:class:`~tasks.training.recorder.EpochRecorder` and Ray Train
(:mod:`integrations.training`) — and owns nothing else. A run with the same identity is
resumed from its newest verified checkpoint; one whose checkpoints say it ended trains no
further.
"""

from __future__ import annotations

import time
from typing import Any

import prefect.runtime
from prefect import get_run_logger
from pydantic import BaseModel

from prefect_ml.integrations import services, storage, tracking, training
from prefect_ml.integrations.compute import ray_session, shipped_code
from prefect_ml.integrations.config.loop import Splits, TrainLoop
from prefect_ml.integrations.errors import PrefectMLError, TrainingCodeError
from prefect_ml.integrations.settings import get_settings
from prefect_ml.integrations.storage import CheckpointStore, Lease, VerifiedCheckpoint
from prefect_ml.integrations.training import training_end
from prefect_ml.tasks.data import PreparedData
from prefect_ml.tasks.params import TrainingSections
from prefect_ml.tasks.training.recorder import EpochRecorder
from prefect_ml.tasks.training.result import TrainResult, train_result

RESUMED_FROM_TAG = "prefect_ml.resumed_from_epoch"  # on runs: the checkpoint a resume started at


def flatten(params: BaseModel) -> dict[str, Any]:
    """``{"training.lr": 0.001, ...}``: nested parameters as MLflow params."""
    flat: dict[str, Any] = {}
    for section, values in params.model_dump(mode="json").items():
        if isinstance(values, dict):
            flat.update({f"{section}.{k}": v for k, v in values.items()})
        else:
            flat[section] = values
    return flat


def current_flow_run_id() -> str:
    """The id of the Prefect flow run this code runs in, or "" outside of one."""
    return str(prefect.runtime.flow_run.id or "")


def train_loop(
    params: TrainingSections,
    data: PreparedData,
    *,
    checkpoint_url: str,
    stop_url: str = "",
) -> TrainLoop:
    """What every training worker receives: the model and training sections themselves, the
    splits (the prepared data's fields that a worker reads) and where the run writes."""
    return TrainLoop(
        model=params.model,
        training=params.training,
        data=Splits.model_validate(data.model_dump(include=set(Splits.model_fields))),
        checkpoint_url=checkpoint_url,
        stop_url=stop_url,
    )


def training_lease(params: TrainingSections, fingerprint: str) -> Lease:
    """The lease that makes this process the only driver of the run with this identity."""
    run_key = params.run_key(fingerprint)
    return Lease(
        storage.training_lease_url(storage.root_url(get_settings()), run_key),
        what=f"training run {run_key} (experiment {params.experiment!r})",
        field="experiment",
        join=True,  # the flow holds it from training through registration
    )


class TrainingRun:
    """One run of a training (a first one or a resumed one) in this process, which holds
    ``lease``; ``shown`` is what the model logs with ``prog_bar=True``, shown per epoch."""

    def __init__(
        self,
        params: TrainingSections,
        data: PreparedData,
        lease: Lease,
        shown: tuple[str, ...] = (),
    ) -> None:
        self.params, self.data, self.lease, self.shown = params, data, lease, shown
        self.settings = get_settings()
        self.logger = get_run_logger()
        self.client = tracking.client_for(self.settings.resolved_tracking_uri)
        self.experiment_id, self.run_id, self.resumed = "", "", False
        self.checkpoint_url = ""

    def run(self) -> TrainResult:
        """Open (or reopen) the MLflow run, train the epochs its checkpoints lack, and return
        how it ended, with its best epoch and early stopping's decision tagged on the run."""
        self.open()
        store = CheckpointStore(self.checkpoint_url)
        latest = store.latest()
        resumed_from = latest.completed_epochs if latest else 0  # a mid-epoch one: the epoch before
        if self.resumed:
            self._log_resume(latest, resumed_from)
        section = self.params.training
        early_stopping, epochs = section.early_stopping(), section.epochs
        with self._recorder():  # also logs epochs a killed process committed but never logged
            # A run that already stopped early (before a crash) trains no further.
            if training_end(store, latest, early_stopping, epochs) is None:
                self.fit()
        self.lease.ensure_held()
        end = training_end(store, store.latest(), early_stopping, epochs)
        if end is None:
            raise PrefectMLError(
                f"training ended without a verified final checkpoint in {self.checkpoint_url}"
            )
        return self.conclude(
            train_result(
                self.params,
                self.data,
                end,
                run_id=self.run_id,
                experiment_id=self.experiment_id,
                checkpoint_url=self.checkpoint_url,
                resumed_from_epoch=resumed_from,
            )
        )

    def open(self) -> None:
        """Start the run's MLflow run, or reopen the unfinished one with its identity, and its
        checkpoints' location, cleared of a dead writer's incomplete uploads."""
        params, data, client = self.params, self.data, self.client
        self.experiment_id = tracking.ensure_experiment(
            client, params.experiment, self.settings.mlflow_artifact_root
        )
        self.run_id, self.resumed = tracking.start_or_resume_run(
            client,
            self.experiment_id,
            params.run_key(data.fingerprint),
            run_name=f"{params.model.model}-{data.fingerprint[:8]}",
            params={**flatten(params), "data.fingerprint": data.fingerprint},
            tags={
                tracking.FINGERPRINT_TAG: data.fingerprint,
                tracking.DATA_LAYOUT_TAG: data.layout,
                tracking.SPLITS_TAG: data.splits_url,
            },
        )
        tracking.record_flow_run(client, self.run_id, current_flow_run_id(), "train")
        if not self.resumed:
            self._log_training_data()
        root = storage.root_url(self.settings)
        self.checkpoint_url = storage.run_checkpoint_url(root, self.experiment_id, self.run_id)
        # A writer killed mid-upload leaves an incomplete multipart upload: invisible, but billed.
        # Only the lease holder writes here, so every incomplete upload is a dead writer's.
        if aborted := storage.abort_incomplete_uploads(self.checkpoint_url):
            self.logger.info(
                "Aborted %d incomplete upload(s) left in %s", aborted, self.checkpoint_url
            )

    def _log_training_data(self) -> None:
        """Lineage: the dataset as the run's MLflow Dataset input, named by its source, digested
        by its fingerprint, profiled by its splits."""
        params, data = self.params, self.data
        source = params.data.url or f"prefect-ml dataset {params.data.dataset}"
        name = (
            params.data.url.rstrip("/").rsplit("/", 1)[-1]
            if params.data.url
            else params.data.dataset
        )
        tracking.log_dataset_input(
            self.client,
            self.run_id,
            name=name,
            digest=data.fingerprint,
            source=source,
            profile={"rows": data.rows, "task": data.task, "layout": data.layout},
            schema={"sample_shape": data.sample_shape, "feature_names": data.feature_names},
        )

    def _log_resume(self, latest: VerifiedCheckpoint | None, resumed_from: int) -> None:
        where = f"epoch {resumed_from}"
        if latest is not None and latest.step is not None:
            where = f"epoch {latest.epoch} step {latest.step}"
        self.logger.info("Resuming MLflow run %s from checkpoint %s", self.run_id, where)
        tracking.set_tags(self.client, self.run_id, {RESUMED_FROM_TAG: str(resumed_from)})

    def _recorder(self) -> EpochRecorder:
        return EpochRecorder(
            self.settings.resolved_tracking_uri,
            self.run_id,
            self.checkpoint_url,
            self.params.training.epochs,
            self.lease,
            headline=self.data.problem.headline,
            shown=self.shown,
        )

    def fit(self) -> None:
        """Train on a Ray Train worker group until the run's last epoch (or early stopping).

        Raises:
            TrainingCodeError: the model's code failed the same way on every try (it says
                what to fix before running again).
            PrefectMLError: any other failure; the run is marked FAILED, and running the same
                command again resumes it from its last verified checkpoint.
        """
        section = self.params.training
        loop = train_loop(
            self.params,
            self.data,
            checkpoint_url=self.checkpoint_url,
            # Workers stop at the next epoch boundary once another driver took the lease over.
            stop_url=self.lease.superseded_url,
        )
        try:
            with ray_session(self.settings):
                if code := shipped_code():
                    tracking.set_tags(self.client, self.run_id, {tracking.CODE_TAG: code})
                services.mark("training run opened (MLflow run, lease); worker group starts")
                training.fit(
                    loop,
                    workers=section.workers,
                    request=section.resources(),
                    max_failures=section.max_failures,
                    ray_storage_url=self.settings.ray_storage_url,
                    name=f"{self.run_id}-{int(time.time())}",
                    logger=self.logger,
                )
                services.mark("training workers done")
                self._mark_worker_group_ready()
        except Exception as exc:
            self.lease.ensure_held()  # the run is the new driver's to mark
            tracking.finish_run(self.client, self.run_id, status="FAILED")
            if isinstance(exc, TrainingCodeError):  # says what to fix before running again
                raise TrainingCodeError(f"training run {self.run_id} failed: {exc}") from exc
            raise PrefectMLError(
                f"training run {self.run_id} failed: {exc}. Run the same command again to "
                "resume from its last verified checkpoint."
            ) from exc

    def _mark_worker_group_ready(self) -> None:
        """Put on the timeline when the latest worker group had built its model and opened its
        data (rank 0 records it when it starts its epochs)."""
        store = CheckpointStore(self.checkpoint_url)
        if not (groups := store.worker_groups()):
            return
        if ready := store.read_worker_group(groups[-1]).get(training.WORKER_GROUP_READY_TAG):
            services.mark("training worker group ready (model built, data opened)", at=float(ready))

    def conclude(self, result: TrainResult) -> TrainResult:
        """Tag the run with the epoch that is evaluated and registered, and why training
        ended where it did."""
        end_tags = {tracking.BEST_EPOCH_TAG: str(result.best_epoch)}
        if result.early_stopped:
            end_tags[tracking.EARLY_STOPPED_TAG] = result.early_stopped
            self.logger.info("Early stopping ended run %s at %s", self.run_id, result.early_stopped)
        tracking.set_tags(self.client, self.run_id, end_tags)
        return result
