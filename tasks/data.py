"""Data steps: inspect (checks, no writes) and preprocess (split, normalise, write, fingerprint)."""

from __future__ import annotations

import hashlib
import json

import numpy as np
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, ValidationError

from integrations import storage
from integrations.catalog import DatasetArrays, load_dataset
from integrations.errors import ConfigurationError
from integrations.settings import get_settings
from tasks.params import CampaignParams, DataParams, TrainingSections
from tasks.retries import transient_retries

FORMAT_VERSION = "1"


class DataSummary(BaseModel):
    """What ``inspect_data`` learnt without writing anything."""

    fingerprint: str
    rows: int
    train_rows: int
    sample_shape: list[int]
    num_classes: int


class PreparedData(BaseModel):
    """Where the splits are and what they hold; small enough to pass between tasks."""

    fingerprint: str
    splits_url: str
    sample_shape: list[int]
    num_classes: int
    class_names: list[str]
    rows: dict[str, int]
    feature_names: list[str] | None = None


def fingerprint_dataset(arrays: DatasetArrays, data: DataParams) -> str:
    """Content hash of the source data and of every parameter that changes the splits."""
    digest = hashlib.sha256()
    for array in (arrays.features, arrays.labels):
        digest.update(str((array.dtype.str, array.shape)).encode())
        digest.update(np.ascontiguousarray(array).tobytes())
    recipe = data.model_dump(
        mode="json", include={"val_fraction", "test_fraction", "split_seed", "normalize"}
    )
    digest.update(
        json.dumps({"classes": arrays.class_names, **recipe, "v": FORMAT_VERSION}).encode()
    )
    return digest.hexdigest()[:20]


def split_indices(labels: np.ndarray, data: DataParams) -> dict[str, np.ndarray]:
    """Seeded, stratified train/val/test row indices (each split shuffled)."""
    from sklearn.model_selection import train_test_split

    rows = np.arange(len(labels))
    try:
        rest, test = train_test_split(
            rows, test_size=data.test_fraction, stratify=labels, random_state=data.split_seed
        )
        train, val = train_test_split(
            rest,
            test_size=data.val_fraction / (1 - data.test_fraction),
            stratify=labels[rest],
            random_state=data.split_seed,
        )
    except ValueError as exc:
        raise ConfigurationError(
            "data.dataset",
            f"cannot make a stratified split ({exc}); every class needs a few rows in each split",
        ) from exc
    return {"train": train, "val": val, "test": test}


def train_rows(total_rows: int, data: DataParams) -> int:
    """Rows of the training split, as ``split_indices`` will make it."""
    test = int(np.ceil(total_rows * data.test_fraction))
    rest = total_rows - test
    return rest - int(np.ceil(rest * data.val_fraction / (1 - data.test_fraction)))


def inspect_dataset(params: TrainingSections) -> DataSummary:
    """Load the data and check what parameters alone cannot; writes nothing anywhere."""
    arrays = load_dataset(params.data.dataset, params.data.loader_options())
    n_train = train_rows(len(arrays.labels), params.data)
    workers = (
        params.sweep.trial_workers
        if isinstance(params, CampaignParams)
        else params.training.worker_range[1]  # the largest group has the smallest shards
    )
    per_worker = n_train // workers
    if params.training.batch_size > n_train:
        raise ConfigurationError(
            "training.batch_size",
            f"{params.training.batch_size} is larger than the training split ({n_train} rows); "
            f"set --batch-size to at most {n_train}",
        )
    if per_worker < 1:
        raise ConfigurationError(
            "training.workers",
            f"{workers} workers for {n_train} training rows leaves some with none; "
            f"use at most {n_train} workers",
        )
    return DataSummary(
        fingerprint=fingerprint_dataset(arrays, params.data),
        rows=len(arrays.labels),
        train_rows=n_train,
        sample_shape=list(arrays.sample_shape),
        num_classes=len(arrays.class_names),
    )


def preprocess_dataset(data: DataParams, fingerprint: str, storage_url: str) -> PreparedData:
    """Split, standardise with training statistics only, write the splits under the fingerprint."""
    arrays = load_dataset(data.dataset, data.loader_options())
    splits = split_indices(arrays.labels, data)
    train = arrays.features[splits["train"]]
    mean = train.mean(axis=0) if data.normalize else np.zeros(arrays.sample_shape, np.float32)
    std = train.std(axis=0) if data.normalize else np.ones(arrays.sample_shape, np.float32)
    std = np.where(std < 1e-6, 1.0, std).astype(np.float32)
    splits_url = storage.join(storage_url, "datasets", fingerprint)
    for name, index in splits.items():
        features = ((arrays.features[index] - mean) / std).astype(np.float32)
        storage.write_array(storage.join(splits_url, f"{name}_features.npy"), features)
        storage.write_array(storage.join(splits_url, f"{name}_labels.npy"), arrays.labels[index])
    storage.write_array(storage.join(splits_url, "mean.npy"), mean.astype(np.float32))
    storage.write_array(storage.join(splits_url, "std.npy"), std)
    prepared = PreparedData(
        fingerprint=fingerprint,
        splits_url=splits_url,
        sample_shape=list(arrays.sample_shape),
        num_classes=len(arrays.class_names),
        class_names=arrays.class_names,
        rows={name: len(index) for name, index in splits.items()},
        feature_names=arrays.feature_names,
    )
    storage.write_bytes(storage.join(splits_url, "meta.json"), prepared.model_dump_json().encode())
    return prepared


def prepared_splits(fingerprint: str, storage_url: str) -> PreparedData | None:
    """The splits already prepared for ``fingerprint`` under ``storage_url``, or None.

    Decided from the splits' own ``meta.json`` (JSON, written after every split), not from a
    Prefect result: those are pickles, and a record planted at their predictable key would run
    in the driver on the next cache hit. The record says what was prepared, never where: the
    location is the one this function read it from.
    """
    splits_url = storage.join(storage_url, "datasets", fingerprint)
    try:
        prepared = PreparedData.model_validate_json(
            storage.read_bytes(storage.join(splits_url, "meta.json"))
        )
    except FileNotFoundError:
        return None
    except ValidationError as exc:
        get_run_logger().warning("Preparing %s again: invalid meta.json (%s)", splits_url, exc)
        return None
    if prepared.fingerprint != fingerprint:
        return None
    return prepared.model_copy(update={"splits_url": splits_url})


@task(name="inspect-data", cache_policy=NO_CACHE, **transient_retries())
def inspect_data(params: TrainingSections) -> DataSummary:
    return inspect_dataset(params)


@task(name="preprocess", cache_policy=NO_CACHE, **transient_retries())
def preprocess(data: DataParams, fingerprint: str) -> PreparedData:
    """The same data and recipe (one fingerprint) are prepared once per storage."""
    storage_url = storage.root_url(get_settings())
    existing = prepared_splits(fingerprint, storage_url)
    if existing is not None:
        get_run_logger().info("Reusing the splits prepared at %s", existing.splits_url)
        return existing
    return preprocess_dataset(data, fingerprint, storage_url)
