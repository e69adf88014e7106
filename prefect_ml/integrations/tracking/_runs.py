"""Runs: experiments in the tenant's namespace, a training's run started or resumed by its
identity, per-epoch metrics and checkpoints, artifacts, lineage and the dataset input."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prefect_ml.integrations import tenancy
from prefect_ml.integrations.errors import ConfigurationError
from prefect_ml.integrations.tracking._tags import (
    DATASET_CONTEXT,
    FLOW_RUN_TAG,
    FLOW_RUNS_TAG_PREFIX,
    REGISTERED_VERSION_TAG,
    RUN_KEY_TAG,
)

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from mlflow import MlflowClient


def check_experiment_name(name: str) -> str:
    """``name`` if it stays inside the artifact root it names a folder of; the experiment's
    artifact location is ``<root>/<name>``, so ``../../elsewhere`` would leave the root."""
    from prefect_ml.integrations import storage

    try:
        storage.check_key(name)
    except ConfigurationError as exc:
        raise ConfigurationError(
            "experiment", f"{exc.message}; give a name without '..' segments or a leading '/'"
        ) from None
    return name


def in_namespace(name: str) -> str:
    """``name`` of an experiment or registered model in the tenant's namespace
    (``PREFECT_ML_TENANT``): ``<tenant>.<name>``, so a tenant never finds another's experiment
    or model, nor moves its aliases. Every function here that takes such a name applies it."""
    from prefect_ml.integrations.settings import get_settings

    return tenancy.qualify(name, get_settings().tenant)


def ensure_experiment(client: MlflowClient, name: str, artifact_root: str | None) -> str:
    """The id of experiment ``name`` (in the tenant's namespace), created (with artifacts
    under ``artifact_root``) if new."""
    from mlflow.exceptions import MlflowException

    check_experiment_name(name)  # before MLflow creates, or finds, anything under that name
    name = in_namespace(name)
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return str(experiment.experiment_id)
    location = f"{artifact_root.rstrip('/')}/{name}" if artifact_root else None
    try:
        return str(client.create_experiment(name, artifact_location=location))
    except MlflowException:  # another process created it a moment ago
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            raise
        return str(experiment.experiment_id)


def start_or_resume_run(
    client: MlflowClient,
    experiment_id: str,
    run_key: str,
    *,
    run_name: str,
    params: dict[str, Any],
    tags: dict[str, str],
) -> tuple[str, bool]:
    """Resume the unfinished run with ``run_key`` or start a new one; returns (run_id, resumed).

    A run that a killed process left RUNNING (or that failed) is the same logical run: resuming
    it keeps one metric history and one set of checkpoints. A FINISHED run is never reopened.
    """
    unfinished = client.search_runs(
        [experiment_id],
        filter_string=f"tags.`{RUN_KEY_TAG}` = '{run_key}' and attributes.status != 'FINISHED'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    if unfinished:
        run_id = unfinished[0].info.run_id
        client.update_run(run_id, status="RUNNING")
        for key, value in tags.items():
            client.set_tag(run_id, key, value)
        return run_id, True
    run = client.create_run(experiment_id, run_name=run_name, tags={RUN_KEY_TAG: run_key, **tags})
    log_params(client, run.info.run_id, params)
    return run.info.run_id, False


@dataclass(frozen=True)
class RegisteredRun:
    """A FINISHED run whose model is a registered version: what a repeat of its training reuses."""

    run_id: str
    experiment_id: str
    model_name: str  # as the registry calls it (the tenant's prefix included)
    version: str
    metrics: dict[str, float]
    tags: dict[str, str]


def registered_run(
    client: MlflowClient, experiment: str, run_key: str, model_name: str
) -> RegisteredRun | None:
    """The newest FINISHED run with ``run_key`` in ``experiment`` that registered a version of
    ``model_name`` (both in the tenant's namespace), or None: that training is not done yet."""
    from mlflow.exceptions import MlflowException

    found = client.get_experiment_by_name(in_namespace(experiment))
    if found is None:
        return None
    finished = client.search_runs(
        [found.experiment_id],
        filter_string=f"tags.`{RUN_KEY_TAG}` = '{run_key}' and attributes.status = 'FINISHED'",
        order_by=["attributes.start_time DESC"],
    )
    name = in_namespace(model_name)
    for run in finished:
        version = run.data.tags.get(REGISTERED_VERSION_TAG)
        if not version:
            continue
        try:
            registered = client.get_model_version(name, version)
        except MlflowException:  # registered under another model name, or deleted since
            continue
        if registered.run_id == run.info.run_id:
            return RegisteredRun(
                run_id=run.info.run_id,
                experiment_id=str(found.experiment_id),
                model_name=name,
                version=version,
                metrics=dict(run.data.metrics),
                tags=dict(run.data.tags),
            )
    return None


def log_params(client: MlflowClient, run_id: str, params: dict[str, Any]) -> None:
    from mlflow.entities import Param

    client.log_batch(run_id, params=[Param(k, str(v)[:6000]) for k, v in sorted(params.items())])


def logged_epochs(client: MlflowClient, run_id: str) -> list[int]:
    """Epochs whose metrics are in the run, in the order they were logged."""
    return [m.step for m in client.get_metric_history(run_id, "val_loss")]


def log_epoch(
    client: MlflowClient,
    run_id: str,
    epoch: int,
    metrics: dict[str, float],
    checkpoint_url: str,
    tags: dict[str, str] | None = None,
) -> None:
    """Log one epoch's metrics and checkpoint URL, and any other ``tags``, in a single (atomic)
    batch."""
    import time

    from mlflow.entities import Metric, RunTag

    now = int(time.time() * 1000)
    client.log_batch(
        run_id,
        metrics=[Metric(k, float(v), now, epoch) for k, v in metrics.items() if math.isfinite(v)],
        tags=[
            *(RunTag(k, v) for k, v in (tags or {}).items()),
            RunTag(f"checkpoint.epoch_{epoch:04d}", checkpoint_url),
            RunTag("checkpoint.latest", checkpoint_url),
        ],
    )


def log_metrics(client: MlflowClient, run_id: str, metrics: dict[str, float]) -> None:
    import time

    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(k, float(v), now, 0) for k, v in metrics.items()])


def set_tags(client: MlflowClient, run_id: str, tags: dict[str, str]) -> None:
    from mlflow.entities import RunTag

    client.log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()])


def log_dict(client: MlflowClient, run_id: str, data: dict[str, Any], artifact_file: str) -> None:
    client.log_dict(run_id, data, artifact_file)


def log_figure(client: MlflowClient, run_id: str, figure: Figure, artifact_file: str) -> None:
    """Log ``figure`` as an image artifact, then release it (pyplot keeps figures alive)."""
    import matplotlib.pyplot as plt

    client.log_figure(run_id, figure, artifact_file)
    plt.close(figure)


def finish_run(client: MlflowClient, run_id: str, status: str = "FINISHED") -> None:
    client.set_terminated(run_id, status=status)


def run_metrics(client: MlflowClient, run_id: str) -> dict[str, float]:
    return dict(client.get_run(run_id).data.metrics)


def record_flow_run(client: MlflowClient, run_id: str, flow_run_id: str, step: str) -> None:
    """Lineage: the flow run ``flow_run_id`` took ``step`` on the run (now). Every flow run
    that touched a run keeps its own tag; :data:`FLOW_RUN_TAG` names the latest."""
    import datetime

    if not flow_run_id:
        return
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    tags = {FLOW_RUN_TAG: flow_run_id, f"{FLOW_RUNS_TAG_PREFIX}{flow_run_id}.{step}": now}
    set_tags(client, run_id, tags)


def flow_runs(tags: dict[str, str]) -> list[tuple[str, str, str]]:
    """(when, flow run id, step) for every flow run that touched a run, oldest first."""
    touched = []
    for key, when in tags.items():
        if key.startswith(FLOW_RUNS_TAG_PREFIX):
            flow_run_id, _, step = key.removeprefix(FLOW_RUNS_TAG_PREFIX).rpartition(".")
            touched.append((when, flow_run_id, step))
    return sorted(touched)


def log_dataset_input(
    client: MlflowClient,
    run_id: str,
    *,
    name: str,
    digest: str,
    source: str,
    profile: dict[str, Any],
    schema: dict[str, Any] | None = None,
) -> None:
    """Log the dataset a run trains on as its MLflow Dataset input (shown in the run's
    Datasets panel): name, digest (the fingerprint's head), source URL and a profile."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    source_type = source.partition("://")[0] if "://" in source else "code"
    dataset = Dataset(
        name=name,
        digest=digest[:36],  # MLflow's column width
        source_type=source_type,
        source=json.dumps({"url": source}),
        schema=json.dumps(schema) if schema else None,
        profile=json.dumps(profile),
    )
    context = InputTag(key="mlflow.data.context", value=DATASET_CONTEXT)
    client.log_inputs(run_id, datasets=[DatasetInput(dataset=dataset, tags=[context])])
