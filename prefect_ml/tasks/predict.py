"""The batch scoring step: a registered version over a dataset's files, as Parquet predictions.

Everything that can be checked without rows is checked before Ray starts: the version (by alias
or number), the files and their shared columns, the model's feature columns in them. A scoring
already complete for the same files and version is reused.
"""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel

from prefect_ml.integrations import datasets, serving, storage, tracking
from prefect_ml.integrations.compute import ray_session
from prefect_ml.integrations.serving import PredictionManifest
from prefect_ml.integrations.settings import get_settings
from prefect_ml.tasks.params import PredictParams, params_from_options, refuse_options_beside
from prefect_ml.tasks.serve import resolve_served_model

__all__ = ["PredictionResult", "score_dataset"]


class PredictionResult(BaseModel):
    """What :func:`score_dataset` returns: the manifest of the predictions it wrote (or found
    complete, ``reused``) and where the version lives in the registry."""

    manifest: PredictionManifest
    reused: bool
    model_version_url: str

    @property
    def output_url(self) -> str:
        return self.manifest.output_url


def predictions_markdown(result: PredictionResult) -> str:
    manifest = result.manifest
    how = (
        "reused: an earlier run scored these files with this version"
        if result.reused
        else (f"scored in {manifest.seconds:.1f} s ({manifest.rows_per_second:,.0f} rows/s)")
    )
    return f"""# Batch predictions of `{manifest.model_name}` v{manifest.model_version}

- **Model**: [`{manifest.model_uri}`]({result.model_version_url}), MLflow run `{manifest.run_id}`
- **Input**: `{manifest.input_url}` ({len(manifest.inputs)} files)
- **Output**: `{manifest.output_url}`, {manifest.rows:,} rows; {how}
- **Columns**: features {manifest.feature_columns}; passed through {manifest.passthrough_columns}
- **Fingerprint**: `{manifest.fingerprint}`
"""


def publish_artifacts(result: PredictionResult) -> None:
    """A markdown summary, a table and a link to the version in the MLflow registry."""
    manifest = result.manifest
    create_markdown_artifact(
        predictions_markdown(result),
        key="batch-predictions",
        description=f"{manifest.model_name} v{manifest.model_version}",
    )
    rows: list[dict[str, Any]] = [
        {"item": "model_version", "value": f"{manifest.model_name} v{manifest.model_version}"},
        {"item": "run_id", "value": manifest.run_id},
        {"item": "rows", "value": manifest.rows},
        {"item": "rows_per_second", "value": round(manifest.rows_per_second)},
        {"item": "output_url", "value": manifest.output_url},
        {"item": "reused", "value": str(result.reused)},
    ]
    create_table_artifact(rows, key="batch-predictions-table")
    create_link_artifact(
        result.model_version_url,
        link_text=f"{manifest.model_name} v{manifest.model_version} in the MLflow registry",
        key="scored-model",
    )


def score_registered_version(params: PredictParams) -> PredictionResult:
    """Resolve, check, then score (or reuse a complete scoring); publishes artifacts."""
    logger = get_run_logger()
    settings = get_settings()
    url = params.required_url()
    storage.prepare_storage(settings)
    served = resolve_served_model(params.model_name, params.alias, params.model_version)
    files = datasets.describe_files(url, "url")
    datasets.check_same_columns(files, "url")
    columns = serving.scoring_columns(files[0], served)
    key = serving.fingerprint(files, served)
    output = params.output or storage.predictions_url(storage.root_url(settings), key)
    manifest = None if params.force else serving.completed(output, key)
    reused = manifest is not None
    if manifest is not None:
        logger.info(
            "Reusing the predictions at %s: %s v%s already scored these files (--force scores "
            "again)",
            output,
            served.name,
            served.version,
        )
    else:
        serving.check_output(output)  # before Ray: a folder of other files is refused
        logger.info(
            "Scoring %d files at %s with %s v%s", len(files), url, served.name, served.version
        )
        with ray_session(settings):
            manifest = serving.score(url, files, served, columns, output, params)
        logger.info("%d rows in %.1f s, written to %s", manifest.rows, manifest.seconds, output)
    link = tracking.model_version_url(settings.resolved_tracking_uri, served.name, served.version)
    result = PredictionResult(manifest=manifest, reused=reused, model_version_url=link)
    publish_artifacts(result)
    return result


@task(name="score-dataset", cache_policy=NO_CACHE)
def score_dataset(params: PredictParams | None = None, **options: Any) -> PredictionResult:
    """Score a dataset's files with a registered version on Ray Data, into Parquet.

    Args:
        params: the predict section, as the flow passes it; or, instead:
        **options: any field of :class:`~prefect_ml.tasks.params.PredictParams`: ``url``
            (required), ``model_name``, ``alias``, ``model_version``, ``output``, ``force``,
            ``batch_size``, ``concurrency``, ``cpus_per_actor``, ``use_gpu``, ...

    Raises:
        ConfigurationError: an unknown or invalid option, a version that does not exist, or
            files that lack the model's feature columns, before any Ray work.
    """
    refuse_options_beside(params, options, step="score_dataset")
    if params is None:
        params = params_from_options(PredictParams, options, step="score_dataset")
    return score_registered_version(params)
