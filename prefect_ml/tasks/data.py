"""Data steps: inspect (checks, no writes) and preprocess (split, normalise, write, fingerprint)."""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any, TypeVar

import numpy as np
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, ValidationError

from prefect_ml.integrations import compute, datasets, problems, storage
from prefect_ml.integrations.config.loop import Layout, Splits
from prefect_ml.integrations.datasets import DatasetArrays, load_dataset
from prefect_ml.integrations.errors import ConfigurationError
from prefect_ml.integrations.settings import get_settings
from prefect_ml.tasks.params import (
    CampaignParams,
    DataParams,
    TrainingParams,
    TrainingSections,
    params_from_options,
    refuse_options_beside,
)
from prefect_ml.tasks.retries import transient_retries

__all__ = ["PreparedData", "preprocess"]

Sections = TypeVar("Sections", bound=TrainingSections)
Logger = logging.Logger | logging.LoggerAdapter[logging.Logger]

FORMAT_VERSION = "1"


class DataSummary(BaseModel):
    """What ``inspect_data`` learnt without writing anything (``train_rows``: expected, for a
    streamed dataset, whose classes are known once it is prepared)."""

    fingerprint: str
    rows: int
    train_rows: int
    sample_shape: list[int]
    num_classes: int | None
    task: str = "classification"
    layout: Layout = "arrays"


class PreparedData(Splits):
    """A prepared dataset: where its splits are and what they hold; small enough to pass
    between tasks. What :func:`preprocess` returns and :func:`~prefect_ml.train` takes.

    Attributes:
        fingerprint: content hash of the source data and the split recipe; names the splits.
        splits_url: storage URL of the train/val/test splits and their statistics.
        sample_shape: shape of one sample's features, e.g. ``[64]`` or ``[1, 8, 8]``.
        task: ``classification`` or ``regression``.
        num_classes, class_names: the classes; for regression 1 (the model's one output) and
            none.
        target_mean, target_std: regression: the training split's target statistics the
            model trains on (0 and 1 when not standardised); the stored labels stay raw.
        layout: ``arrays`` (``.npy`` splits, read whole: small data) or ``parquet`` (Parquet
            shards streamed by the workers); see :mod:`integrations.datasets`.
        rows: rows per split (``train``, ``val``, ``test``).
        feature_names: the columns of a tabular dataset, else None.
        recipe: the data parameters the splits were prepared with.
    """

    fingerprint: str
    class_names: list[str]
    rows: dict[str, int]
    feature_names: list[str] | None = None
    recipe: DataParams | None = None

    @property
    def problem(self) -> problems.Problem:
        return problems.problem(self.task)

    def shard(self, split: str) -> datasets.Shard:
        """All the rows of ``split`` (``train``, ``val`` or ``test``), read as they are used."""
        return datasets.open_shard(self.splits_url, self.layout, split, tuple(self.sample_shape))


def fingerprint_dataset(arrays: DatasetArrays, data: DataParams) -> str:
    """Content hash of the source data and of every parameter that changes the splits."""
    digest = hashlib.sha256()
    for array in (arrays.features, arrays.labels):
        digest.update(str((array.dtype.str, array.shape)).encode())
        digest.update(np.ascontiguousarray(array).tobytes())
    recipe = data.model_dump(
        mode="json", include={"val_fraction", "test_fraction", "split_seed", "normalize"}
    )
    if data.task != "classification":  # classification data keeps the fingerprint it had
        recipe.update(task=data.task, standardize_target=data.standardize_target)
    digest.update(
        json.dumps({"classes": arrays.class_names, **recipe, "v": FORMAT_VERSION}).encode()
    )
    return digest.hexdigest()[:20]


def fingerprint_source(source: datasets.TabularSource, data: DataParams) -> str:
    """The identity of streamed files (names, sizes, versions: no bytes read) and of every
    parameter that changes their splits."""
    recipe = data.model_dump(
        mode="json",
        include={
            "val_fraction",
            "test_fraction",
            "split_seed",
            "normalize",
            "task",
            "standardize_target",
        },
    )
    identity = {**source.identity(), **recipe, "layout": "parquet", "v": FORMAT_VERSION}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]


def choose_layout(data: DataParams) -> tuple[Layout, datasets.TabularSource | None]:
    """How ``data`` is prepared (PREFECT_ML_DATA_LAYOUT): streamed as Parquet shards when it is a
    tabular dataset of at least PREFECT_ML_STREAM_MIN_MB, else as arrays; a tabular dataset's
    files are described (from metadata) either way."""
    settings = get_settings()
    if data.dataset != "tabular":
        if settings.data_layout == "parquet":
            raise ConfigurationError(
                "PREFECT_ML_DATA_LAYOUT",
                f"'parquet' streams a tabular dataset's files, and {data.dataset!r} is not one; "
                "unset it or use --dataset tabular --url <files>",
            )
        return "arrays", None
    assert data.url is not None and data.label_column is not None  # DataParams checks both
    source = datasets.describe_source(data.url, data.label_column, data.task)
    big = source.total_bytes >= settings.stream_min_mb * 2**20
    if settings.data_layout == "parquet" or (settings.data_layout == "auto" and big):
        return "parquet", source
    return "arrays", source


def split_indices(labels: np.ndarray, data: DataParams) -> dict[str, np.ndarray]:
    """Seeded train/val/test row indices (each split shuffled), stratified by class for
    classification and random for regression."""
    from sklearn.model_selection import train_test_split

    rows = np.arange(len(labels))
    stratified = data.task == "classification"
    try:
        rest, test = train_test_split(
            rows,
            test_size=data.test_fraction,
            stratify=labels if stratified else None,
            random_state=data.split_seed,
        )
        train, val = train_test_split(
            rest,
            test_size=data.val_fraction / (1 - data.test_fraction),
            stratify=labels[rest] if stratified else None,
            random_state=data.split_seed,
        )
    except ValueError as exc:
        raise ConfigurationError(
            "data.dataset",
            f"cannot make a stratified split ({exc}); every class needs a few rows in each "
            "split. If the label is a number to predict, not a class, set --task regression",
        ) from exc
    return {"train": train, "val": val, "test": test}


def train_rows(total_rows: int, data: DataParams) -> int:
    """Rows of the training split, as ``split_indices`` will make it."""
    test = int(np.ceil(total_rows * data.test_fraction))
    rest = total_rows - test
    return rest - int(np.ceil(rest * data.val_fraction / (1 - data.test_fraction)))


def check_fits_training_split(
    params: TrainingSections, n_train: int, *, workers: int | None = None
) -> None:
    """Refuse a batch size or a worker count (``workers``: a campaign trial's) that a training
    split of ``n_train`` rows cannot feed, before any compute."""
    training: TrainingParams = params.training
    if workers is None:
        workers = (
            params.sweep.trial_workers
            if isinstance(params, CampaignParams)
            else training.worker_range[1]  # the largest group has the smallest shards
        )
    if training.batch_size > n_train:
        raise ConfigurationError(
            "training.batch_size",
            f"{training.batch_size} is larger than the training split ({n_train} rows); "
            f"set --batch-size to at most {n_train}",
        )
    if n_train // workers < 1:
        raise ConfigurationError(
            "training.workers",
            f"{workers} workers for {n_train} training rows leaves some with none; "
            f"use at most {n_train} workers",
        )


def params_on_data(
    params_type: type[Sections],
    data: PreparedData,
    params: Sections | None,
    options: dict[str, Any],
    *,
    step: str,
    experiment: str,
) -> Sections:
    """A public task's training or campaign sections: ``params`` as a flow passes them, or
    built from the keyword ``options`` (a convenience) for the prepared ``data``, whose recipe
    they record; either is checked against the data's training split.

    Raises:
        ConfigurationError: both ``params`` and ``options`` given, an unknown or invalid
            option, or a batch size or worker count the training split cannot feed.
    """
    refuse_options_beside(params, options, step=step)
    if params is None:
        params = params_from_options(
            params_type, options, step=step, experiment=experiment, data=data.recipe or DataParams()
        )
    check_fits_training_split(params, data.rows["train"])
    return params


def inspect_dataset(params: TrainingSections) -> DataSummary:
    """Check what parameters alone cannot; writes nothing anywhere. Streamed data is checked
    from its files' metadata, other data is loaded."""
    layout, source = choose_layout(params.data)
    if layout == "parquet" and source is not None:
        n_train = train_rows(source.rows, params.data)
        check_fits_training_split(params, n_train)
        return DataSummary(
            fingerprint=fingerprint_source(source, params.data),
            rows=source.rows,
            train_rows=n_train,
            sample_shape=[len(source.feature_columns)],
            num_classes=None,
            task=params.data.task,
            layout=layout,
        )
    arrays = load_dataset(params.data.dataset, params.data.loader_options(), params.data.task)
    split_indices(arrays.labels, params.data)  # a split that cannot be made fails here, not later
    n_train = train_rows(len(arrays.labels), params.data)
    check_fits_training_split(params, n_train)
    return DataSummary(
        fingerprint=fingerprint_dataset(arrays, params.data),
        rows=len(arrays.labels),
        train_rows=n_train,
        sample_shape=list(arrays.sample_shape),
        num_classes=len(arrays.class_names) or 1,
        task=params.data.task,
    )


def preprocess_dataset(
    data: DataParams, fingerprint: str, storage_url: str, arrays: DatasetArrays | None = None
) -> PreparedData:
    """Split, standardise with training statistics only, write the splits under the fingerprint
    (``arrays``: the dataset, when already loaded)."""
    arrays = arrays or load_dataset(data.dataset, data.loader_options(), data.task)
    splits = split_indices(arrays.labels, data)
    train = arrays.features[splits["train"]]
    target_mean, target_std = 0.0, 1.0
    if data.task == "regression" and data.standardize_target:
        targets = arrays.labels[splits["train"]].astype(np.float64)
        target_mean, target_std = float(targets.mean()), float(targets.std()) or 1.0
    mean = train.mean(axis=0) if data.normalize else np.zeros(arrays.sample_shape, np.float32)
    std = train.std(axis=0) if data.normalize else np.ones(arrays.sample_shape, np.float32)
    std = np.where(std < 1e-6, 1.0, std).astype(np.float32)
    splits_url = storage.dataset_url(storage_url, fingerprint)
    for name, index in splits.items():
        features = ((arrays.features[index] - mean) / std).astype(np.float32)
        storage.write_array(storage.split_array_url(splits_url, name, "features"), features)
        labels = arrays.labels[index]
        storage.write_array(storage.split_array_url(splits_url, name, "labels"), labels)
    storage.write_array(storage.statistic_url(splits_url, "mean"), mean.astype(np.float32))
    storage.write_array(storage.statistic_url(splits_url, "std"), std)
    prepared = PreparedData(
        fingerprint=fingerprint,
        splits_url=splits_url,
        sample_shape=list(arrays.sample_shape),
        num_classes=len(arrays.class_names) or 1,
        class_names=arrays.class_names,
        rows={name: len(index) for name, index in splits.items()},
        feature_names=arrays.feature_names,
        recipe=data,
        task=data.task,
        target_mean=target_mean,
        target_std=target_std,
    )
    storage.write_bytes(storage.dataset_meta_url(splits_url), prepared.model_dump_json().encode())
    return prepared


def preprocess_streamed(
    data: DataParams, source: datasets.TabularSource, fingerprint: str, storage_url: str
) -> PreparedData:
    """Split, standardise and write ``source`` as Parquet shards with Ray Data, on the
    cluster (see :mod:`integrations.datasets`)."""
    splits_url = storage.dataset_url(storage_url, fingerprint)
    recipe = datasets.SplitRecipe(
        features=source.feature_columns,
        label=source.label_column,
        task=data.task,
        seed=data.split_seed,
        val_fraction=data.val_fraction,
        test_fraction=data.test_fraction,
    )
    with compute.ray_session(get_settings()):
        written = datasets.prepare(
            source,
            recipe,
            splits_url,
            normalize=data.normalize,
            standardize_target=data.standardize_target,
        )
    prepared = PreparedData(
        fingerprint=fingerprint,
        splits_url=splits_url,
        sample_shape=[len(recipe.features)],
        num_classes=len(written.class_names) or 1,
        class_names=written.class_names,
        rows=written.rows,
        feature_names=recipe.features,
        recipe=data,
        task=data.task,
        target_mean=written.target_mean,
        target_std=written.target_std,
        layout="parquet",
    )
    storage.write_bytes(storage.dataset_meta_url(splits_url), prepared.model_dump_json().encode())
    return prepared


def prepared_splits(
    fingerprint: str, storage_url: str, logger: Logger | None = None
) -> PreparedData | None:
    """The splits already prepared for ``fingerprint`` under ``storage_url``, or None.

    Decided from the splits' own ``meta.json`` (JSON, written after every split), not from a
    Prefect result: those are pickles, and a record planted at their predictable key would run
    in the driver on the next cache hit. The record says what was prepared, never where: the
    location is the one this function read it from.
    """
    splits_url = storage.dataset_url(storage_url, fingerprint)
    try:
        prepared = PreparedData.model_validate_json(
            storage.read_bytes(storage.dataset_meta_url(splits_url))
        )
    except FileNotFoundError:
        return None
    except ValidationError as exc:
        (logger or get_run_logger()).warning(
            "Preparing %s again: invalid meta.json (%s)", splits_url, exc
        )
        return None
    if prepared.fingerprint != fingerprint:
        return None
    return prepared.model_copy(update={"splits_url": splits_url})


@task(name="inspect-data", cache_policy=NO_CACHE, **transient_retries())
def inspect_data(params: TrainingSections) -> DataSummary:
    return inspect_dataset(params)


@task(name="preprocess", cache_policy=NO_CACHE, **transient_retries())
def preprocess(dataset: str = "digits", **options: Any) -> PreparedData:
    """Load a dataset, split it (train/val/test, seeded and stratified), standardise it with the
    training split's statistics and write the splits to storage under its fingerprint.

    A tabular dataset of at least ``PREFECT_ML_STREAM_MIN_MB`` (or any, with
    ``PREFECT_ML_DATA_LAYOUT=parquet``) is never loaded here: Ray Data splits it per row by a
    seeded hash (not stratified), standardises it in a streaming pass and writes Parquet shards
    that the workers stream (see :mod:`integrations.datasets`); its fingerprint covers the
    files' names, sizes and versions, not their bytes.

    The same data and recipe (one fingerprint) are prepared once per storage: a later call
    reuses the splits.

    Args:
        dataset: ``"digits"``, ``"tabular"`` (with ``url``: a file, directory or glob of
            CSV or Parquet files, and ``label_column``), a
            ``prefect_ml.datasets`` plug-in or an allowed ``package.module:loader``.
        **options: any other field of :class:`~prefect_ml.tasks.params.DataParams`: ``url``,
            ``label_column``, ``dataset_options``, ``val_fraction``, ``test_fraction``,
            ``split_seed``, ``normalize``.

    Returns:
        The prepared dataset, for :func:`~prefect_ml.train` and :func:`~prefect_ml.campaign`.

    Raises:
        ConfigurationError: an unknown or invalid option, before anything is read or written.
    """
    data = params_from_options(DataParams, {"dataset": dataset, **options}, step="preprocess")
    settings = get_settings()
    storage.prepare_storage(settings)
    return prepare_data(data, storage.root_url(settings), get_run_logger())


def prepare_data(data: DataParams, storage_url: str, logger: Logger) -> PreparedData:
    """:func:`preprocess` as a plain function: the splits of ``data`` under ``storage_url``,
    reused when that fingerprint was already prepared there (a campaign also calls it for the
    dataset options its trials draw)."""
    layout, source = choose_layout(data)
    arrays = None
    if layout == "parquet" and source is not None:
        fingerprint = fingerprint_source(source, data)
    else:
        arrays = load_dataset(data.dataset, data.loader_options(), data.task)
        fingerprint = fingerprint_dataset(arrays, data)
    existing = prepared_splits(fingerprint, storage_url, logger)
    if existing is not None:
        logger.info("Reusing the splits prepared at %s", existing.splits_url)
        return existing.model_copy(update={"recipe": data})
    if source is not None and layout == "parquet":
        logger.info(
            "Streaming %d file(s), %.0f MB, into Parquet shards with Ray Data",
            len(source.files),
            source.total_bytes / 1e6,
        )
        return preprocess_streamed(data, source, fingerprint, storage_url)
    return preprocess_dataset(data, fingerprint, storage_url, arrays)
