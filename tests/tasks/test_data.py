from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from prefect import flow

from integrations import storage
from integrations.catalog import load_dataset
from integrations.errors import ConfigurationError
from integrations.settings import PrefectMLSettings
from tasks.data import inspect_dataset, preprocess, preprocess_dataset, split_indices, train_rows
from tasks.params import DataParams, TrainModelParams


def test_splits_are_stratified_disjoint_and_seeded() -> None:
    labels = load_dataset("digits", {}).labels
    data = DataParams()
    splits = split_indices(labels, data)
    assert sum(len(s) for s in splits.values()) == len(labels)
    assert len(set(np.concatenate(list(splits.values())).tolist())) == len(labels)
    assert len(splits["train"]) == train_rows(len(labels), data)
    overall = np.bincount(labels) / len(labels)
    for index in splits.values():
        assert np.abs(np.bincount(labels[index], minlength=10) / len(index) - overall).max() < 0.02
    again = split_indices(labels, data)
    assert all(np.array_equal(splits[k], again[k]) for k in splits)
    other = split_indices(labels, DataParams(split_seed=1))
    assert not np.array_equal(splits["test"], other["test"])


def test_normalisation_uses_training_statistics_only(home: PrefectMLSettings) -> None:
    data = DataParams()
    summary = inspect_dataset(TrainModelParams())
    prepared = preprocess_dataset(data, summary.fingerprint, home.resolved_storage_url)
    read = lambda name: storage.read_array(storage.join(prepared.splits_url, name))  # noqa: E731
    train = read("train_features.npy")
    assert np.allclose(train.mean(axis=0), 0, atol=1e-4)
    raw = load_dataset("digits", {}).features
    split = split_indices(load_dataset("digits", {}).labels, data)
    assert np.allclose(read("mean.npy"), raw[split["train"]].mean(axis=0), atol=1e-5)
    assert not np.allclose(read("test_features.npy").mean(axis=0), 0, atol=1e-4)
    assert prepared.rows == {"train": 1257, "val": 270, "test": 270}
    assert prepared.sample_shape == [1, 8, 8] and prepared.num_classes == 10


def test_fingerprint_follows_content_and_recipe() -> None:
    base = inspect_dataset(TrainModelParams()).fingerprint
    assert inspect_dataset(TrainModelParams()).fingerprint == base
    reseeded = TrainModelParams.model_validate({"data": {"split_seed": 3}})
    assert inspect_dataset(reseeded).fingerprint != base
    other = TrainModelParams.model_validate({"data": {"dataset": "tests.fixtures.user_code:blobs"}})
    assert inspect_dataset(other).fingerprint != base


def test_batch_larger_than_training_split_is_refused() -> None:
    params = TrainModelParams.model_validate({"training": {"batch_size": 5000}})
    with pytest.raises(ConfigurationError) as error:
        inspect_dataset(params)
    assert error.value.field == "training.batch_size"
    assert "1257 rows" in str(error.value) and "--batch-size" in str(error.value)


def test_preprocess_is_cached_by_prefect_on_the_fingerprint(
    home: PrefectMLSettings, tmp_path: Path
) -> None:
    @flow
    def prepare_twice() -> list[str]:
        summary = inspect_dataset(TrainModelParams())
        states = [
            preprocess(DataParams(), summary.fingerprint, return_state=True) for _ in range(2)
        ]
        return [state.name for state in states]

    assert prepare_twice() == ["Completed", "Cached"]
    meta = Path(storage.join(home.resolved_storage_url, "datasets").removeprefix("file://"))
    assert len(list(meta.iterdir())) == 1
