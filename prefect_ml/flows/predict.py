"""``batch_predict``: a registered version (the alias's, or a number) scores a dataset's files
on Ray Data into Parquet predictions."""

from __future__ import annotations

from prefect import flow

from prefect_ml.tasks.params import PredictParams
from prefect_ml.tasks.predict import PredictionResult, score_dataset
from prefect_ml.tasks.report import published_timeline

__all__ = ["batch_predict"]


@flow(name="batch-predict")
def batch_predict(params: PredictParams = PredictParams()) -> PredictionResult:  # noqa: B008
    """Score the CSV or Parquet files at a URL with ``models:/<name>@<alias>`` (or a version);
    the predictions of the same files by the same version are reused unless forced.

    Args:
        params: Which registered version, which files, where the predictions go, and how the
            scoring actors run.
    """
    with published_timeline("batch-predict"):
        return score_dataset(params)
