"""MLflow: runs, per-epoch metrics, evaluation artifacts, registered versions and aliases.

Everything goes through an explicit ``MlflowClient(tracking_uri)`` rather than the global
``mlflow.*`` state, because the same process (and Ray workers) may talk to several runs and
tracking URIs; global state would leak between them. The only exception is
``mlflow.pytorch.log_model``, which needs an active run and is scoped with ``start_run(run_id)``.
"""

from __future__ import annotations

import json
import math
import os
import queue
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

if TYPE_CHECKING:
    import numpy as np
    import torch
    from matplotlib.figure import Figure
    from mlflow import MlflowClient
    from mlflow.entities.model_registry import ModelVersion

from prefect_ml.integrations import tenancy
from prefect_ml.integrations.errors import ConfigurationError
from prefect_ml.integrations.redaction import MASK, masked

RUN_KEY_TAG = "prefect_ml.run_key"
FLOW_RUN_TAG = "prefect.flow_run_id"
FINGERPRINT_TAG = "prefect_ml.dataset_fingerprint"
DATA_LAYOUT_TAG = "prefect_ml.data_layout"  # arrays (read whole) or parquet (streamed)
SOURCE_RUN_TAG = "prefect_ml.mlflow_run_id"
SAMPLE_SHAPE_TAG = "prefect_ml.sample_shape"  # JSON, on model versions: what serving validates
CLASS_NAMES_TAG = "prefect_ml.class_names"
FEATURE_NAMES_TAG = "prefect_ml.feature_names"
TASK_TAG = "prefect_ml.task"  # on model versions: classification or regression
INPUT_DTYPE_TAG = "prefect_ml.input_dtype"  # on model versions: float32 unless it says float64
BEST_EPOCH_TAG = "prefect_ml.best_epoch"  # on runs: the epoch evaluated and registered
EARLY_STOPPED_TAG = "prefect_ml.early_stopped"  # on runs: where early stopping ended training
REGISTERED_VERSION_TAG = "registered_version"  # on runs: the version registered from the run


_INITIALISED: set[str] = set()


def shipped_uri(tracking_uri: str) -> str:
    """``tracking_uri`` as it may travel to Ray (actor and task arguments, which Ray's
    dashboard and state API show): its password masked; a worker gets it back with
    :func:`worker_uri`."""
    return masked(tracking_uri)


def worker_uri(shipped: str) -> str:
    """The tracking URI a Ray worker given ``shipped`` (:func:`shipped_uri`) uses: ``shipped``
    itself when nothing was masked, else this node's own setting (PREFECT_ML_MLFLOW_TRACKING_URI
    or MLFLOW_TRACKING_URI, as for the checkpoint key: secrets are not shipped), which must be
    the same URI."""
    if MASK not in shipped:
        return shipped
    from prefect_ml.integrations.settings import get_settings

    local = get_settings().resolved_tracking_uri
    if masked(local) != shipped:
        raise ConfigurationError(
            "PREFECT_ML_MLFLOW_TRACKING_URI",
            f"this Ray node's MLflow tracking URI is {masked(local)!r}, the driver's "
            f"{shipped!r}: the password is not shipped to Ray workers, so set the same "
            "PREFECT_ML_MLFLOW_TRACKING_URI (or MLFLOW_TRACKING_URI) on every node",
        )
    return local


def client_for(tracking_uri: str) -> MlflowClient:
    from mlflow import MlflowClient
    from mlflow.tracking.registry import UnsupportedModelRegistryStoreURIException

    if not tracking_uri.startswith(("sqlite:///", "postgresql")) or tracking_uri in _INITIALISED:
        try:
            return MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
        except UnsupportedModelRegistryStoreURIException:
            # A wrong scheme stays wrong: a configuration error, which is never retried.
            raise ConfigurationError(
                "PREFECT_ML_MLFLOW_TRACKING_URI",
                f"{masked(tracking_uri)!r} is not an MLflow tracking URI; use sqlite:///<file>, "
                "postgresql://... or the http(s) address of an MLflow server",
            ) from None
    # MLflow creates a new database's tables when a client first opens it; two processes doing
    # it at once collide ("table already exists", on PostgreSQL "duplicate key value violates
    # unique constraint pg_type_typname_nsp_index"). A lock makes one of them wait.
    with _initialisation_lock(tracking_uri):
        client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
        client.search_registered_models(max_results=1)  # the registry store initialises too
    _INITIALISED.add(tracking_uri)
    return client


@contextmanager
def _initialisation_lock(tracking_uri: str) -> Iterator[None]:
    """Held by one process at a time per database: a file lock beside an SQLite file (whose
    schema is built aside, :func:`_create_sqlite_database`), an advisory lock in PostgreSQL."""
    if tracking_uri.startswith("sqlite:///"):
        import fcntl

        database = tracking_uri.removeprefix("sqlite:///")
        os.makedirs(os.path.dirname(database) or ".", exist_ok=True)
        with open(f"{database}.init-lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not os.path.exists(database):
                _create_sqlite_database(database)
            yield
        return
    import sqlalchemy

    engine = sqlalchemy.create_engine(tracking_uri, poolclass=sqlalchemy.NullPool)
    try:
        with engine.connect() as connection:
            # A session lock, released by the unlock or when the connection closes.
            connection.execute(sqlalchemy.text(f"SELECT pg_advisory_lock({_INIT_LOCK_KEY})"))
            try:
                yield
            finally:
                connection.execute(sqlalchemy.text(f"SELECT pg_advisory_unlock({_INIT_LOCK_KEY})"))
    finally:
        engine.dispose()


_INIT_LOCK_KEY = 0x70726566_6D6C  # "prefml": the advisory lock key of MLflow's schema creation


def _create_sqlite_database(database: str) -> None:
    """Create MLflow's schema in a temporary file, then move it into place.

    MLflow's migrations (alembic) take many statements; a process killed in between left a
    half-migrated database on which every later run failed ("table _alembic_tmp_experiments
    already exists", found by the chaos runs). Built aside and renamed, the database is either
    absent or whole. Called under the init lock, so leftovers of killed creators can go.
    """
    import glob

    import sqlalchemy
    from mlflow.store.db.utils import _initialize_tables  # what MLflow's own store runs

    for leftover in glob.glob(f"{glob.escape(database)}.creating-*"):
        os.remove(leftover)
    staging = f"{database}.creating-{os.getpid()}"
    engine = sqlalchemy.create_engine(f"sqlite:///{staging}")
    try:
        _initialize_tables(engine)
    finally:
        engine.dispose()
    os.replace(staging, database)


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


def _ui_base(tracking_uri: str) -> str:
    """The MLflow UI: the tracking server itself, or a local ``mlflow ui`` on its default port."""
    base = masked(tracking_uri) if tracking_uri.startswith("http") else "http://127.0.0.1:5000"
    return base.rstrip("/")


def run_url(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    """Where a person opens the run."""
    return f"{_ui_base(tracking_uri)}/#/experiments/{experiment_id}/runs/{run_id}"


def model_version_url(tracking_uri: str, model_name: str, version: str) -> str:
    """Where a person opens a registered model version."""
    return f"{_ui_base(tracking_uri)}/#/models/{quote(model_name)}/versions/{version}"


@dataclass(frozen=True)
class PromotionDecision:
    """Whether a new version took the alias, and why, in words a person can act on."""

    promoted: bool
    reason: str
    previous_version: str | None
    previous_value: float | None


def decide_promotion(
    new_value: float,
    champion_value: float | None,
    *,
    metric: str,
    direction: str,
    min_delta: float,
    champion_version: str | None,
) -> PromotionDecision:
    """Promote when there is no champion or the new value beats it by at least ``min_delta``."""
    if champion_value is None:
        return PromotionDecision(True, f"no current champion; {metric}={new_value:.4f}", None, None)
    gain = new_value - champion_value if direction == "maximize" else champion_value - new_value
    verdict = gain >= min_delta and gain > 0
    comparison = "beats" if verdict else "does not beat"
    reason = (
        f"{metric}={new_value:.4f} {comparison} champion v{champion_version} "
        f"({champion_value:.4f}) by the required {min_delta:g} ({direction}; gain {gain:+.4f})"
    )
    return PromotionDecision(verdict, reason, champion_version, champion_value)


def champion(client: MlflowClient, model_name: str, alias: str) -> tuple[str, str] | None:
    """(version, run_id) holding ``alias``, or None if the model or alias does not exist yet."""
    from mlflow.exceptions import MlflowException

    try:
        version = client.get_model_version_by_alias(in_namespace(model_name), alias)
    except MlflowException:
        return None
    return str(version.version), str(version.run_id)


def registered_version(
    client: MlflowClient, model_name: str, *, alias: str, version: str | None
) -> ModelVersion:
    """The version numbered ``version``, else the one holding ``alias``; a clear error if none."""
    from mlflow.exceptions import MlflowException

    from prefect_ml.integrations.settings import get_settings

    tenant = get_settings().tenant
    model_name = tenancy.qualify(model_name, tenant)
    try:
        registered = client.get_registered_model(model_name)
    except MlflowException:
        models = client.search_registered_models(max_results=200)
        known = sorted(m.name for m in models if tenancy.owns(m.name, tenant))
        raise ConfigurationError(
            "model_name",
            f"no registered model {model_name!r} in {masked(client.tracking_uri)}; registered: "
            f"{known}. "
            "Train one (prefect-ml train) or check MLFLOW_TRACKING_URI / PREFECT_ML_HOME",
        ) from None
    if version is not None:
        try:
            return client.get_model_version(model_name, version)
        except MlflowException:
            versions = sorted(
                int(v.version) for v in client.search_model_versions(f"name='{model_name}'")
            )
            raise ConfigurationError(
                "model_version", f"{model_name} has no version {version}; its versions: {versions}"
            ) from None
    try:
        return client.get_model_version_by_alias(model_name, alias)
    except MlflowException:
        raise ConfigurationError(
            "alias",
            f"{model_name} has no alias @{alias}; its aliases: {dict(registered.aliases)}. "
            "Promote a version to it, or pass --model-version",
        ) from None


def log_and_register_model(
    client: MlflowClient,
    tracking_uri: str,
    run_id: str,
    model: torch.nn.Module,
    input_example: np.ndarray,
    *,
    model_name: str,
    tags: dict[str, str],
) -> str:
    """Log ``model`` (signature, input example) to the run and register it; return the version.

    The signature is a tensor of the example's dtype and shape: the pt2 format (torch.export,
    no pickle) accepts no other kind, so column names travel in :data:`FEATURE_NAMES_TAG`.
    """
    import mlflow
    import mlflow.pytorch
    import torch
    from mlflow.models import infer_signature

    model = model.eval()
    with torch.no_grad():
        output = model(torch.from_numpy(input_example)).numpy()
    signature = infer_signature(input_example, output)
    mlflow.set_tracking_uri(tracking_uri)
    mlflow.set_registry_uri(tracking_uri)
    with mlflow.start_run(run_id=run_id, log_system_metrics=False):
        info = mlflow.pytorch.log_model(
            model,
            name="model",
            signature=signature,
            input_example=input_example,
            serialization_format="pt2",  # torch.export: loads without unpickling code
            pip_requirements=[f"torch=={torch.__version__.split('+')[0]}", "mlflow"],
        )
    model_name = in_namespace(model_name)
    _ensure_registered_model(client, model_name)
    # A tracking server checks that a models:/ source names its logged model (the local store
    # does not): pass model_id.
    version = client.create_model_version(
        model_name, info.model_uri, run_id=run_id, tags=tags, model_id=info.model_id
    )
    return str(version.version)


def load_pt2_model(model_dir: str, *, what: str) -> torch.nn.Module:
    """The PyTorch model logged at ``model_dir`` (a downloaded ``models:/`` URI), loaded only if
    it is a ``torch.export`` (pt2) archive with no code of its own.

    A pickle-format version (``model.pth``) would run code while it loads, and MLflow imports
    the pickle module its files name even before it checks whether pickle is allowed; a model
    logged with ``code_paths`` puts its own files first on ``sys.path``. Both are refused here,
    before MLflow reads anything but the MLmodel file, and the pt2 archive itself is checked by
    MLflow for pickle payloads (``MLFLOW_ALLOW_PICKLE_DESERIALIZATION=false``). ``what`` names
    the version in the error.
    """
    import mlflow.pytorch
    from mlflow.models import Model

    from prefect_ml.integrations.settings import ENFORCED_ENVIRONMENT

    flavor = Model.load(model_dir).flavors.get("pytorch") or {}
    data_dir = os.path.join(model_dir, str(flavor.get("model_data", "data")))
    pt2 = os.path.isfile(os.path.join(data_dir, "model.pt2"))
    pickled = os.path.exists(os.path.join(data_dir, "model.pth"))
    problem = None
    if not flavor:
        problem = "is not a PyTorch model"
    elif flavor.get("code"):
        problem = "ships its own code (code_paths), which would go first on sys.path"
    elif pickled or not pt2:
        problem = "is not saved as pt2 but with pickle, which runs code when it loads"
    if problem:
        raise ConfigurationError(
            "model_version",
            f"{what} {problem}; refusing to load it. Register a pt2 version "
            "(prefect-ml train does; mlflow.pytorch.log_model(..., serialization_format='pt2')) "
            "and move the alias to it",
        )
    os.environ.update(ENFORCED_ENVIRONMENT)  # also in a process we did not start
    return mlflow.pytorch.load_model(model_dir)  # type: ignore[no-any-return]


def _ensure_registered_model(client: MlflowClient, model_name: str) -> None:
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(model_name)
    except MlflowException:
        client.create_registered_model(model_name)


def set_alias(client: MlflowClient, model_name: str, alias: str, version: str) -> None:
    client.set_registered_model_alias(in_namespace(model_name), alias, version)


def tag_version(client: MlflowClient, model_name: str, version: str, tags: dict[str, str]) -> None:
    model_name = in_namespace(model_name)
    for key, value in tags.items():
        client.set_model_version_tag(model_name, version, key, value)


FLOW_RUNS_TAG_PREFIX = "prefect_ml.flow_run."  # on runs: <flow run id>.<step> -> when
SPLITS_TAG = "prefect_ml.splits_url"  # on training runs: the prepared splits it trained on
DATASET_CONTEXT = "training"  # the mlflow.data.context of a training run's dataset input


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


SERVING_TAG_PREFIX = "prefect_ml.serving."  # on versions, one per Serve application (JSON)
CANARY_TAG = "prefect_ml.canary"  # on versions: the verdict of its canary rollout


def record_serving(
    client: MlflowClient, model_name: str, version: str, app_name: str, record: dict[str, Any]
) -> None:
    """Where and since when ``version`` is served (``url``, ``since``, ``share``; ``until``
    once another version took the application over), as a tag of the version."""
    tag_version(client, model_name, version, {SERVING_TAG_PREFIX + app_name: json.dumps(record)})


def serving_records(version: ModelVersion) -> dict[str, dict[str, Any]]:
    """Application name -> the record :func:`record_serving` left on ``version``."""
    return {
        key.removeprefix(SERVING_TAG_PREFIX): json.loads(value)
        for key, value in version.tags.items()
        if key.startswith(SERVING_TAG_PREFIX)
    }


def check_writable(tracking_uri: str, artifact_root: str | None) -> str:
    """Connect to the tracking store and check that its backing files can be written."""

    from prefect_ml.integrations import storage

    client_for(tracking_uri).search_experiments(max_results=1)
    if tracking_uri.startswith("sqlite:///"):
        database = tracking_uri.removeprefix("sqlite:///")
        if not os.access(database, os.W_OK):
            raise PermissionError(f"{database} is not writable")
    if artifact_root:
        storage.check_writable(artifact_root)
    return f"{masked(tracking_uri)} reachable" + (
        f", artifacts at {artifact_root}" if artifact_root else ""
    )


# Campaigns: one parent run per campaign, one nested run per trial.
PARENT_TAG = "mlflow.parentRunId"  # MLflow's own tag: the UI nests runs by it
CAMPAIGN_TAG = "prefect_ml.campaign"  # on trial runs
CAMPAIGN_PARENT_TAG = "prefect_ml.campaign_parent"  # on the campaign's parent run
TRIAL_TAG = "prefect_ml.trial_number"
TRIAL_STATE_TAG = "prefect_ml.trial_state"
ERROR_TAG = "prefect_ml.error"
WORKER_TAG = "prefect_ml.worker_pid"  # the process that trained a trial (warm workers are reused)
CODE_TAG = "prefect_ml.code"  # on a cluster: what the job shipped (prefect-ml, user modules)
NODE_TAG = "prefect_ml.worker_node"  # the address of the Ray node that trained a trial
RESUMED_TAG = "prefect_ml.resumed_from_epoch"  # a retried trial continued from this checkpoint


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
