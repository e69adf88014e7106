"""A trained model scoring a streamed test split: Ray Data actors each load the checkpoint's
model once and score batches of the split's Parquet shards; the driver receives the summed test
statistics of the task (``Problem.test_sums``) and a sample of (predicted, actual) pairs, never
the rows."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import numpy as np

from prefect_ml.integrations import datasets, problems, storage
from prefect_ml.integrations.datasets import BATCH_ROWS
from prefect_ml.integrations.training._resume import load_trained_model

if TYPE_CHECKING:
    import pyarrow


class _TestScorer:
    """A Ray Data actor: the checkpoint's model, loaded once, scoring batches of test rows."""

    def __init__(self, checkpoint_url: str, loop: dict[str, Any]) -> None:
        self.loop = loop
        self.model, _ = load_trained_model(
            checkpoint_url,
            loop["model"],
            loop["input_shape"],
            loop["num_classes"],
            loop["model_options"],
            epoch=loop.get("epoch"),  # None: the newest verified checkpoint
        )
        self.problem = problems.problem(loop["task"])

    def __call__(self, batch: pyarrow.Table) -> dict[str, np.ndarray]:
        import torch

        features, labels = datasets.table_arrays(batch, tuple(self.loop["input_shape"]))
        with torch.no_grad():
            outputs = self.model(torch.from_numpy(features)).float().numpy()
        if self.problem.name == "regression":
            outputs = outputs * self.loop["target_std"] + self.loop["target_mean"]
        sums = self.problem.test_sums(outputs, labels, self.loop["num_classes"])
        sample = [outputs.reshape(-1)[:SAMPLE_ROWS].tolist(), labels[:SAMPLE_ROWS].tolist()]
        return {"sums": sums[None], "sample": np.array([json.dumps(sample)])}


SAMPLE_ROWS = 64  # per batch, for a regression's predicted-against-actual figure


def score_split(
    splits_url: str, files: list[datasets.ShardFile], checkpoint_url: str, loop: dict[str, Any]
) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """The summed test statistics (``Problem.test_sums``) of the checkpoint's model over
    ``files``, scored by Ray Data actors, and a sample of (predicted, actual) pairs."""
    import ray.data

    located = [storage.ray_storage(storage.join(splits_url, f.name)) for f in files]
    dataset = ray.data.read_parquet(
        [path for path, _ in located], filesystem=located[0][1], partitioning=None
    )
    scored = dataset.map_batches(
        _TestScorer,
        fn_constructor_kwargs={"checkpoint_url": checkpoint_url, "loop": loop},
        batch_format="pyarrow",
        batch_size=BATCH_ROWS,
        concurrency=(1, 2),
    )
    total: np.ndarray | None = None
    predicted: list[float] = []
    actual: list[float] = []
    for batch in scored.iter_batches(batch_size=None, batch_format="numpy"):
        sums = batch["sums"].sum(axis=0)
        total = sums if total is None else total + sums
        for listed in batch["sample"]:
            guess, truth = json.loads(str(listed))
            predicted += guess
            actual += truth
    assert total is not None, "a prepared test split is never empty"
    return total, (np.array(predicted), np.array(actual))
