"""The model registry: logging and registering a model as pt2, loading one only if it is pt2,
the champion alias and the promotion decision, and where each version is served."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any

from prefect_ml.integrations import tenancy
from prefect_ml.integrations.errors import ConfigurationError
from prefect_ml.integrations.redaction import masked
from prefect_ml.integrations.tracking._runs import in_namespace
from prefect_ml.integrations.tracking._tags import SERVING_TAG_PREFIX

if TYPE_CHECKING:
    import numpy as np
    import torch
    from mlflow import MlflowClient
    from mlflow.entities.model_registry import ModelVersion


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
    the version in the error. :func:`check_loadable` says the same before anything deploys.
    """
    import mlflow.pytorch
    from mlflow.models import Model

    from prefect_ml.integrations.settings import ENFORCED_ENVIRONMENT

    flavors = Model.load(model_dir).flavors
    data_dir = os.path.join(model_dir, _data_folder(flavors))
    names = os.listdir(data_dir) if os.path.isdir(data_dir) else []
    _refuse_unsafe(flavors, {n for n in names if os.path.isfile(os.path.join(data_dir, n))}, what)
    os.environ.update(ENFORCED_ENVIRONMENT)  # also in a process we did not start
    return mlflow.pytorch.load_model(model_dir)  # type: ignore[no-any-return]


def check_loadable(client: MlflowClient, version: ModelVersion) -> None:
    """Refuse, before anything is deployed, a registered ``version`` that no replica would load
    (:func:`load_pt2_model`): one with no MLmodel file, or not a pt2 PyTorch model. Reads its
    MLmodel file and the names in its data folder only, not its weights, so a failure to load
    those still shows in the replica."""
    import mlflow.artifacts
    from mlflow.exceptions import MlflowException
    from mlflow.models import Model

    what = f"models:/{version.name}/{version.version}"
    tracking_uri = client.tracking_uri
    location = client.get_model_version_download_uri(version.name, version.version).rstrip("/")
    with tempfile.TemporaryDirectory() as folder:
        try:
            mlmodel = mlflow.artifacts.download_artifacts(
                artifact_uri=f"{location}/MLmodel", dst_path=folder, tracking_uri=tracking_uri
            )
        except (MlflowException, OSError) as exc:
            raise ConfigurationError(
                "model_version",
                f"{what} has no MLmodel file at {masked(location)}, so it cannot load "
                f"({type(exc).__name__}); register a version logged with "
                "mlflow.pytorch.log_model and move the alias to it",
            ) from None
        flavors = Model.load(mlmodel).flavors
    listed = mlflow.artifacts.list_artifacts(
        artifact_uri=f"{location}/{_data_folder(flavors)}", tracking_uri=tracking_uri
    )
    _refuse_unsafe(flavors, {PurePosixPath(f.path).name for f in listed if not f.is_dir}, what)


def _data_folder(flavors: dict[str, Any]) -> str:
    return str((flavors.get("pytorch") or {}).get("model_data", "data"))


def _refuse_unsafe(flavors: dict[str, Any], data_files: set[str], what: str) -> None:
    """A ConfigurationError unless the MLmodel ``flavors`` and the files of the model's data
    folder are a pt2 PyTorch model with no code of its own."""
    flavor = flavors.get("pytorch") or {}
    problem = None
    if not flavor:
        problem = "is not a PyTorch model"
    elif flavor.get("code"):
        problem = "ships its own code (code_paths), which would go first on sys.path"
    elif "model.pth" in data_files or "model.pt2" not in data_files:
        problem = "is not saved as pt2 but with pickle, which runs code when it loads"
    if problem:
        raise ConfigurationError(
            "model_version",
            f"{what} {problem}; refusing to load it. Register a pt2 version "
            "(prefect-ml train does; mlflow.pytorch.log_model(..., serialization_format='pt2')) "
            "and move the alias to it",
        )


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
