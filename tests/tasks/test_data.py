from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from prefect import flow

from prefect_ml.integrations import storage
from prefect_ml.integrations.datasets import load_dataset
from prefect_ml.integrations.errors import ConfigurationError
from prefect_ml.integrations.settings import PrefectMLSettings
from prefect_ml.tasks.data import (
    PreparedData,
    fingerprint_dataset,
    inspect_dataset,
    prepared_splits,
    preprocess,
    preprocess_dataset,
    split_indices,
    train_rows,
)
from prefect_ml.tasks.params import DataParams, TrainModelParams


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


def test_preprocess_reuses_splits_it_finds_by_their_own_metadata(home: PrefectMLSettings) -> None:
    summary = inspect_dataset(TrainModelParams())

    @flow
    def prepare_twice() -> list[PreparedData]:
        return [preprocess() for _ in range(2)]

    first, second = prepare_twice()
    assert first == second
    datasets = Path(storage.join(home.resolved_storage_url, "datasets").removeprefix("file://"))
    assert [p.name for p in datasets.iterdir()] == [summary.fingerprint]
    features = datasets / summary.fingerprint / "train_features.npy"
    written = features.stat().st_mtime_ns
    (datasets / summary.fingerprint / "meta.json").write_text("not json")  # a broken record
    assert prepare_twice()[0] == first and features.stat().st_mtime_ns > written


class _Planted:
    """A pickle that creates a file when it is loaded: what an attacker plants in storage."""

    def __init__(self, canary: Path) -> None:
        self.canary = str(canary)

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (exec, (f"open({self.canary!r}, 'w').close()",))


def test_a_planted_cache_record_is_never_unpickled(home: PrefectMLSettings, tmp_path: Path) -> None:
    """The preprocess cache used to be a Prefect result (a pickle) at a predictable key."""
    import hashlib

    from prefect.results import ResultStore
    from prefect.serializers import PickleSerializer

    canary = tmp_path / "canary"
    summary = inspect_dataset(TrainModelParams())
    where = hashlib.sha256(home.resolved_storage_url.encode()).hexdigest()[:12]
    key = f"preprocess-{summary.fingerprint}-{where}"

    @flow
    def plant_then_prepare() -> PreparedData:
        ResultStore(serializer=PickleSerializer()).write(_Planted(canary), key=key)
        return preprocess()

    prepared = plant_then_prepare()
    assert not canary.exists()
    assert prepared.fingerprint == summary.fingerprint and prepared.rows["train"] == 1257


def test_a_record_pointing_elsewhere_is_not_followed(
    home: PrefectMLSettings, tmp_path: Path
) -> None:
    summary = inspect_dataset(TrainModelParams())
    splits = storage.join(home.resolved_storage_url, "datasets", summary.fingerprint)
    record = PreparedData(
        fingerprint=summary.fingerprint,
        splits_url=(tmp_path / "elsewhere").as_uri(),
        sample_shape=[1, 8, 8],
        num_classes=10,
        class_names=[str(c) for c in range(10)],
        rows={"train": 1, "val": 1, "test": 1},
    )
    storage.write_bytes(storage.join(splits, "meta.json"), record.model_dump_json().encode())
    found = prepared_splits(summary.fingerprint, home.resolved_storage_url)
    assert found is not None and found.splits_url == splits


def _diabetes_csv(folder: Path) -> Path:
    from sklearn.datasets import load_diabetes

    path = folder / "diabetes.csv"
    load_diabetes(as_frame=True).frame.to_csv(path, index=False)
    return path


def _tabular(path: Path, task: str) -> TrainModelParams:
    data = {"dataset": "tabular", "url": path.as_uri(), "label_column": "target", "task": task}
    return TrainModelParams.model_validate({"data": data})


def test_a_continuous_target_splits_at_random_as_regression(
    home: PrefectMLSettings, tmp_path: Path
) -> None:
    """The issue's reproduction: as classes, 214 target values cannot be stratified."""
    csv = _diabetes_csv(tmp_path)
    with pytest.raises(ConfigurationError, match="set --task regression"):
        inspect_dataset(_tabular(csv, "classification"))
    params = _tabular(csv, "regression")
    summary = inspect_dataset(params)
    assert (summary.task, summary.num_classes, summary.rows) == ("regression", 1, 442)
    prepared = preprocess_dataset(params.data, summary.fingerprint, home.resolved_storage_url)
    assert prepared.rows == {"train": 308, "val": 67, "test": 67}
    assert prepared.class_names == [] and prepared.feature_names[:2] == ["age", "sex"]
    splits = Path(prepared.splits_url.removeprefix("file://"))
    train_targets = np.load(splits / "train_labels.npy")
    assert train_targets.dtype == np.float32  # raw values, standardised by the training loop
    assert prepared.target_mean == pytest.approx(float(train_targets.mean()), rel=1e-5)
    assert prepared.target_std == pytest.approx(float(train_targets.std()), rel=1e-5)
    unscaled = _tabular(csv, "regression").data
    unscaled.standardize_target = False
    arrays = load_dataset("tabular", unscaled.loader_options(), "regression")
    assert fingerprint_dataset(arrays, unscaled) != summary.fingerprint  # another recipe


@pytest.mark.parametrize("bad", ["", "n/a", "inf"])
def test_a_regression_target_that_is_not_a_number_fails_naming_the_column_and_rows(
    tmp_path: Path, bad: str
) -> None:
    csv = tmp_path / "broken.csv"
    rows = [f"{i},{i * 2}" for i in range(30)]
    rows[3], rows[17] = f"3,{bad}", "17,seventeen"
    csv.write_text("x,y\n" + "\n".join(rows) + "\n")
    data = {"dataset": "tabular", "url": csv.as_uri(), "label_column": "y", "task": "regression"}
    with pytest.raises(ConfigurationError) as refused:
        inspect_dataset(TrainModelParams.model_validate({"data": data}))
    assert refused.value.field == "data.label_column"
    assert "column 'y'" in str(refused.value) and "in 2 of 30 rows" in str(refused.value)
    assert "rows [3, 17]" in str(refused.value)
