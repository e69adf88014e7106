"""The training step: one MLflow run, trained data-parallel on Ray Train, resumable."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import prefect.runtime
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from prefect_ml.integrations import (
    catalog,
    hooks,
    model_parallel,
    ray_training,
    storage,
    timeline,
    tracking,
    training,
)
from prefect_ml.integrations.checkpoints import CheckpointStore
from prefect_ml.integrations.config.loop import Splits, TrainLoop
from prefect_ml.integrations.errors import CheckpointError, PrefectMLError, TrainingCodeError
from prefect_ml.integrations.leases import Lease
from prefect_ml.integrations.prefect_server import RAY_TAG
from prefect_ml.integrations.ray_cluster import ray_session, shipped_code
from prefect_ml.integrations.settings import get_settings
from prefect_ml.integrations.training import METRICS_FILE, TrainingEnd, training_end
from prefect_ml.tasks.data import PreparedData, params_on_data
from prefect_ml.tasks.params import ModelParams, TrainingSections
from prefect_ml.tasks.placement import check_placement
from prefect_ml.tasks.retries import transient_retries

__all__ = ["TrainResult", "train"]

RESUMED_FROM_TAG = "prefect_ml.resumed_from_epoch"  # on runs: the checkpoint a resume started at
T = TypeVar("T")

if TYPE_CHECKING:
    import torch
    from mlflow import MlflowClient


class TrainResult(BaseModel):
    """A finished training run: what :func:`train` returns, and all that
    :func:`~prefect_ml.evaluate` and :func:`~prefect_ml.register` need of it.

    Attributes:
        run_id, experiment_id: the MLflow run that holds its parameters, metrics and model.
        checkpoint_url: where its verified checkpoints are.
        final_epoch, resumed_from_epoch: the last epoch, and the epoch a resumed run started at
            (0 from scratch).
        best_epoch: the epoch whose checkpoint is evaluated and registered: with early
            stopping, the best epoch of its metric; otherwise the final epoch.
        early_stopped: where and why early stopping ended training (``"epoch 7 of 12; best
            epoch 4 (val_loss 0.123)"``); None when every epoch trained.
        epoch_metrics: the last epoch's metrics (``train_loss``, ``val_loss`` and the task's:
            ``val_accuracy``, or ``val_rmse``, ``val_mae``, ``val_r2``).
        model: the network it trained (the model section), to rebuild it from the checkpoint.
        data: the prepared dataset it trained on.
        reused: whether this is an earlier, finished and registered run of the same identity,
            returned instead of training again (``train_model`` without ``--force``).
    """

    run_id: str
    experiment_id: str
    checkpoint_url: str
    final_epoch: int
    resumed_from_epoch: int
    best_epoch: int
    epoch_metrics: dict[str, float]
    model: ModelParams
    data: PreparedData
    early_stopped: str | None = None
    reused: bool = False


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


class EpochRecorder:
    """Logs each committed epoch to MLflow exactly once, and shows it (rich bar, log line).

    Workers only commit checkpoints, each holding its epoch's metrics; this driver-side poller
    turns verified checkpoints into the run's metric history. The checkpoint store is the source
    of truth, so epochs that a killed process committed but never logged are logged on resume,
    and no epoch is logged twice (this is the run's only metric writer: with ``lease``, it stops
    logging once the lease is lost to another driver).
    """

    def __init__(
        self,
        tracking_uri: str,
        run_id: str,
        checkpoint_url: str,
        epochs: int,
        lease: Lease | None = None,
        headline: str = "val_accuracy",
        shown: tuple[str, ...] = (),
    ) -> None:
        self._client = tracking.client_for(tracking_uri)
        self._headline = headline  # the task's metric shown next to the loss
        self._shown = shown  # and what the model logged with prog_bar=True
        self._lease = lease
        self._run_id, self._epochs = run_id, epochs
        self._store = CheckpointStore(checkpoint_url)
        self._logged = set(tracking.logged_epochs(self._client, run_id))
        self._recorded_any = False  # whether this recorder logged an epoch yet
        self._logger = get_run_logger()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._progress = Progress(
            TextColumn("[bold]training"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[metrics]}"),
            TimeElapsedColumn(),
        )
        self._bar = self._progress.add_task("epochs", total=epochs, metrics="")

    def __enter__(self) -> EpochRecorder:
        self._progress.start()
        self.record_new_epochs()
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()
        self.record_new_epochs()
        self._progress.stop()

    def _poll(self) -> None:
        while not self._stop.wait(1.0):
            self.record_new_epochs()

    def record_new_epochs(self) -> None:
        for epoch in self._store.epochs():
            if self._lease is not None and self._lease.lost:
                return
            if epoch in self._logged:
                continue
            try:
                metrics = json.loads(self._store.read_verified(epoch, METRICS_FILE))
            except CheckpointError:
                continue  # not committed yet; a later poll sees it
            tracking.log_epoch(
                self._client, self._run_id, epoch, metrics, self._store.url_for(epoch)
            )
            if not self._recorded_any:
                timeline.mark(f"epoch {epoch} committed (seen by the driver's 1 s poll)")
                self._recorded_any = True
            self._logged.add(epoch)
            shown = [
                "train_loss",
                *(name for name in (self._headline, *self._shown) if name != "train_loss"),
            ]
            values = "  ".join(f"{name} {metrics[name]:.4f}" for name in shown if name in metrics)
            line = f"{values}  {metrics['samples_per_second']:,.0f} samples/s"
            self._logger.info("epoch %d/%d  %s", epoch, self._epochs, line)
            self._progress.update(self._bar, completed=len(self._logged), metrics=line)


def train_loop(
    params: TrainingSections,
    data: PreparedData,
    *,
    checkpoint_url: str,
    tracking_uri: str,
    run_id: str,
    stop_url: str = "",
) -> TrainLoop:
    """What every training worker receives: the model and training sections themselves, the
    splits (the prepared data's fields that a worker reads) and where the run writes."""
    return TrainLoop(
        model=params.model,
        training=params.training,
        data=Splits.model_validate(data.model_dump(include=set(Splits.model_fields))),
        checkpoint_url=checkpoint_url,
        tracking_uri=tracking.shipped_uri(tracking_uri),  # Ray shows task arguments
        run_id=run_id,
        stop_url=stop_url,
    )


def check_model(params: TrainingSections, data: PreparedData) -> hooks.Probe | None:
    """Refuse, before any run starts, a model that cannot train as asked: one whose factory
    raises, one without the ``--gradient-checkpointing`` hook, or one whose own hooks
    (integrations.hooks: steps, ``configure_optimizers``, ``compute_loss``,
    ``compute_metrics``) break their contract. Returns what a hooked model's steps log.

    The model is built on torch's meta device when it can be (no memory, no initialisation
    cost), else on the CPU: a model whose construction computes with tensors (``.item()``,
    pretrained weights) fails on meta but is valid. A model with hooks is built on the CPU and
    tried once on two training rows, so a hook that returns the wrong thing fails here, naming
    the hook, not in every worker. An error of the user's code is a :class:`TrainingCodeError`,
    which no retry repeats.
    """
    import torch

    def build() -> torch.nn.Module:
        options = params.model.factory_options()
        return catalog.build_model(params.model.model, data.sample_shape, data.num_classes, options)

    try:
        with torch.device("meta"):
            model = build()
    except Exception:  # the meta device is only an optimisation: build it for real
        model = _users_code(build, params, "its factory")
    if params.training.gradient_checkpointing:
        catalog.check_gradient_checkpointing(model)
    training = params.training
    if training.strategy in model_parallel.SIZE_FIELDS and isinstance(training.workers, int):
        size = getattr(training, model_parallel.SIZE_FIELDS[training.strategy]) or training.workers
        model_parallel.check_split(model, training.strategy, size)
    own = [
        name for name in ("compute_loss", "compute_metrics") if callable(getattr(model, name, None))
    ]
    if not (hooks.is_hooked(model) or own):
        return None
    if hooks.is_hooked(model):
        hooks.check_contract(model, strategy=params.training.strategy)
    if next(iter(model.parameters()), torch.empty(0)).is_meta:
        model = _users_code(build, params, "its factory")
    rows, raw_labels = data.shard("train").head(2)
    targets = data.problem.targets(raw_labels, data.target_mean, data.target_std)
    features, labels = torch.from_numpy(rows), torch.from_numpy(targets)
    if hooks.is_hooked(model):
        epochs = params.training.epochs
        return _users_code(
            lambda: hooks.probe_steps(model, features, labels, epochs), params, "its hooks"
        )

    def steps() -> None:
        loss = hooks.loss_function(model, data.problem)(model(features), labels)
        hooks.check_loss(loss, model, "compute_loss")
        if extra := hooks.metrics_function(model):
            with torch.no_grad():
                hooks.checked_metrics(extra(model(features), labels), model, "compute_metrics")

    _users_code(steps, params, "its loss and metrics")
    return None


def _users_code(call: Callable[[], T], params: TrainingSections, what: str) -> T:
    """``call()``, with an exception of the user's model code (not one of prefect-ml's, which
    names its field already) as a :class:`TrainingCodeError`: deterministic, never retried."""
    try:
        return call()
    except PrefectMLError:
        raise
    except Exception as exc:
        raise TrainingCodeError(
            f"the model {params.model.model} failed the pre-flight check of {what} on two "
            f"training rows, before any worker started: {type(exc).__name__}: {exc}. Fix the "
            "model's code; no retry would change this"
        ) from exc


def train_result(
    params: TrainingSections,
    data: PreparedData,
    end: TrainingEnd,
    *,
    run_id: str,
    experiment_id: str,
    checkpoint_url: str,
    resumed_from_epoch: int,
    reused: bool = False,
) -> TrainResult:
    """The :class:`TrainResult` of a run that ended as ``end`` says."""
    return TrainResult(
        run_id=run_id,
        experiment_id=experiment_id,
        checkpoint_url=checkpoint_url,
        final_epoch=end.final.epoch,
        resumed_from_epoch=resumed_from_epoch,
        best_epoch=end.best_epoch,
        early_stopped=end.stopped.describe(params.training.epochs) if end.stopped else None,
        epoch_metrics=json.loads(end.final.files[METRICS_FILE]),
        model=params.model,
        data=data,
        reused=reused,
    )


def log_training_data(
    client: MlflowClient, run_id: str, params: TrainingSections, data: PreparedData
) -> None:
    """Lineage: the dataset as the run's MLflow Dataset input, named by its source, digested
    by its fingerprint, profiled by its splits."""
    source = params.data.url or f"prefect-ml dataset {params.data.dataset}"
    name = (
        params.data.url.rstrip("/").rsplit("/", 1)[-1] if params.data.url else params.data.dataset
    )
    tracking.log_dataset_input(
        client,
        run_id,
        name=name,
        digest=data.fingerprint,
        source=source,
        profile={"rows": data.rows, "task": data.task, "layout": data.layout},
        schema={"sample_shape": data.sample_shape, "feature_names": data.feature_names},
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


def train_distributed(params: TrainingSections, data: PreparedData) -> TrainResult:
    """Train on Ray Train workers, resuming the unfinished run with the same identity if any.

    The run's lease is taken first: a second driver of the same run is refused before it
    reopens the MLflow run or touches its uploads, and is released on the way out (a Prefect
    retry in this process takes it again).
    """
    probe = check_model(params, data)
    shown = tuple(sorted(probe.prog_bar)) if probe else ()
    with training_lease(params, data.fingerprint) as lease:
        return _train_holding(params, data, lease, shown)


def _train_holding(
    params: TrainingSections, data: PreparedData, lease: Lease, shown: tuple[str, ...] = ()
) -> TrainResult:
    logger = get_run_logger()
    settings = get_settings()
    client = tracking.client_for(settings.resolved_tracking_uri)
    experiment_id = tracking.ensure_experiment(
        client, params.experiment, settings.mlflow_artifact_root
    )
    run_id, resumed = tracking.start_or_resume_run(
        client,
        experiment_id,
        params.run_key(data.fingerprint),
        run_name=f"{params.model.model}-{data.fingerprint[:8]}",
        params={**flatten(params), "data.fingerprint": data.fingerprint},
        tags={
            tracking.FINGERPRINT_TAG: data.fingerprint,
            tracking.DATA_LAYOUT_TAG: data.layout,
            tracking.SPLITS_TAG: data.splits_url,
        },
    )
    tracking.record_flow_run(client, run_id, current_flow_run_id(), "train")
    if not resumed:
        log_training_data(client, run_id, params, data)
    checkpoint_url = storage.run_checkpoint_url(storage.root_url(settings), experiment_id, run_id)
    # A writer killed mid-upload leaves an incomplete multipart upload: invisible, but billed.
    # Only the lease holder writes here, so every incomplete upload is a dead writer's.
    if aborted := storage.abort_incomplete_uploads(checkpoint_url):
        logger.info("Aborted %d incomplete upload(s) left in %s", aborted, checkpoint_url)
    store = CheckpointStore(checkpoint_url)
    latest = store.latest()
    resumed_from = latest.completed_epochs if latest else 0  # a mid-epoch one: the epoch before
    if resumed:
        where = f"epoch {resumed_from}"
        if latest is not None and latest.step is not None:
            where = f"epoch {latest.epoch} step {latest.step}"
        logger.info("Resuming MLflow run %s from checkpoint %s", run_id, where)
        tracking.set_tags(client, run_id, {RESUMED_FROM_TAG: str(resumed_from)})
    loop = train_loop(
        params,
        data,
        checkpoint_url=checkpoint_url,
        tracking_uri=settings.resolved_tracking_uri,
        run_id=run_id,
        # Workers stop at the next epoch boundary once another driver took the lease over.
        stop_url=lease.superseded_url,
    )
    early_stopping, epochs = params.training.early_stopping(), params.training.epochs
    recorder = EpochRecorder(
        settings.resolved_tracking_uri,
        run_id,
        checkpoint_url,
        params.training.epochs,
        lease,
        headline=data.problem.headline,
        shown=shown,
    )
    with recorder:  # also logs epochs a killed process committed but never logged
        # A run that already stopped early (before a crash) trains no further.
        if training_end(store, latest, early_stopping, epochs) is None:
            try:
                with ray_session(settings):
                    if code := shipped_code():
                        tracking.set_tags(client, run_id, {tracking.CODE_TAG: code})
                    timeline.mark("training run opened (MLflow run, lease); worker group starts")
                    ray_training.fit(
                        loop,
                        workers=params.training.workers,
                        request=params.training.worker_request(),
                        max_failures=params.training.max_failures,
                        ray_storage_url=settings.ray_storage_url,
                        name=f"{run_id}-{int(time.time())}",
                        logger=logger,
                    )
                    timeline.mark("training workers done")
                    mark_worker_group_ready(client, run_id)
            except Exception as exc:
                lease.ensure_held()  # the run is the new driver's to mark
                tracking.finish_run(client, run_id, status="FAILED")
                if isinstance(exc, TrainingCodeError):  # says what to fix before running again
                    raise TrainingCodeError(f"training run {run_id} failed: {exc}") from exc
                raise PrefectMLError(
                    f"training run {run_id} failed: {exc}. Run the same command again to "
                    "resume from its last verified checkpoint."
                ) from exc
    lease.ensure_held()
    end = training_end(store, store.latest(), early_stopping, epochs)
    if end is None:
        raise PrefectMLError(
            f"training ended without a verified final checkpoint in {checkpoint_url}"
        )
    result = train_result(
        params,
        data,
        end,
        run_id=run_id,
        experiment_id=experiment_id,
        checkpoint_url=checkpoint_url,
        resumed_from_epoch=resumed_from,
    )
    # The epoch that is evaluated and registered, and why training ended where it did.
    end_tags = {tracking.BEST_EPOCH_TAG: str(result.best_epoch)}
    if result.early_stopped:
        end_tags[tracking.EARLY_STOPPED_TAG] = result.early_stopped
        logger.info("Early stopping ended run %s at %s", run_id, result.early_stopped)
    tracking.set_tags(client, run_id, end_tags)
    return result


def mark_worker_group_ready(client: Any, run_id: str) -> None:
    """Put on the timeline when the latest worker group had built its model and opened its
    data (rank 0 stamps the run when it starts its epochs)."""
    if ready := client.get_run(run_id).data.tags.get(ray_training.WORKER_GROUP_READY_TAG):
        timeline.mark("training worker group ready (model built, data opened)", at=float(ready))


def trained_model(trained: TrainResult) -> torch.nn.Module:
    """The model of the run's best verified checkpoint (``best_epoch``), in eval mode."""
    model, _epoch = training.load_trained_model(
        trained.checkpoint_url,
        trained.model.model,
        trained.data.sample_shape,
        trained.data.num_classes,
        trained.model.factory_options(),
        epoch=trained.best_epoch,
    )
    return model


@task(name="train", cache_policy=NO_CACHE, tags=[RAY_TAG, "training"], **transient_retries())
def train(
    data: PreparedData,
    params: TrainingSections | None = None,
    *,
    experiment: str = "prefect-ml",
    **options: Any,
) -> TrainResult:
    """Train a model data-parallel on Ray Train workers, tracked as one MLflow run.

    Checkpoints are written (verified) every epoch; running the same training again (same
    experiment, data and options that shape the result) resumes that run from its last
    checkpoint instead of starting over.

    Args:
        data: what :func:`~prefect_ml.preprocess` returned.
        params: the experiment and the model and training sections, as the flows pass them
            (:class:`~prefect_ml.tasks.params.TrainingSections`); or, instead:
        experiment: the MLflow experiment.
        **options: any field of the model and training sections
            (:class:`~prefect_ml.tasks.params.ModelParams`,
            :class:`~prefect_ml.tasks.params.TrainingParams`), e.g. ``model="mlp"`` or an
            allowed ``"my_pkg.models:build"``, ``hidden``, ``epochs``, ``workers`` (a number or
            ``(min, max)``), ``lr``, ``batch_size``, ``use_gpu``, ``precision``, ``strategy``.

    Returns:
        The finished run, for :func:`~prefect_ml.evaluate` and :func:`~prefect_ml.register`.

    Raises:
        ConfigurationError: an unknown or invalid option, or a request the cluster cannot
            place, before any compute.
    """
    params = params_on_data(
        TrainingSections, data, params, options, step="train", experiment=experiment
    )
    with ray_session(get_settings()):  # one Ray for the placement check and the training
        check_placement(params)
        return train_distributed(params, data)
