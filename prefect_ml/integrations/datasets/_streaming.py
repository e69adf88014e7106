"""Ray Data pipelines over a tabular dataset's files, run on the cluster: preparing streamed
splits (a trained model scores a streamed test split in ``training``'s ``_test_scoring``). The
driver receives statistics, never rows.

Preparing takes two streaming passes over the source files:

1. **statistics**: each row's split is drawn from a seeded hash of its values (the same row
   lands in the same split on every run, whatever the files' order or the cluster's size, and
   duplicate rows never straddle two splits); per batch, the training rows' feature sums and
   sums of squares, the regression target's, and every label seen; the driver adds them up.
2. **write**: the rows again, standardised with those statistics, labels as class ids, written
   as Parquet shards (``features``: a fixed-size list of float32, ``label``), one folder per
   split, row groups of a few MB so that a worker reads them in small steps.

The split is random per row, not stratified: at the sizes streamed, each class's share per
split is its share overall within sampling noise (a class with a handful of rows may miss a
split). Stratifying would need the class counts before the split, a third pass.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from prefect_ml.integrations import storage
from prefect_ml.integrations.datasets import _shards, _tabular_files
from prefect_ml.integrations.errors import ConfigurationError

if TYPE_CHECKING:
    import pandas as pd
    import pyarrow
    import ray.data

BATCH_ROWS = 8192
ROW_GROUP_BYTES = 8 * 2**20
FILE_BYTES = 256 * 2**20
SPLITS = ("train", "val", "test")
MAX_CLASSES = 10_000  # more distinct labels than this: a number to regress, not classes


@dataclass(frozen=True)
class SplitRecipe:
    """How rows are assigned and labelled: what both passes compute per row."""

    features: list[str]
    label: str
    task: str
    seed: int
    val_fraction: float
    test_fraction: float

    def splits(self, batch: pd.DataFrame) -> np.ndarray:
        """Each row's split (0 train, 1 val, 2 test) from a seeded hash of its values."""
        import pandas as pd

        values = pd.DataFrame(batch[self.features].to_numpy(np.float32), columns=self.features)
        values[self.label] = batch[self.label].astype(str).to_numpy()  # by position, not index
        key = f"{self.seed:016d}"[-16:]
        uniform = pd.util.hash_pandas_object(values, index=False, hash_key=key).to_numpy()
        uniform = uniform.astype(np.float64) / 2.0**64
        return np.where(
            uniform < self.test_fraction,
            2,
            np.where(uniform < self.test_fraction + self.val_fraction, 1, 0),
        )


@dataclass
class Moments:
    """Count, mean and sum of squared deviations of a column (or of each column), combined
    batch by batch with Chan's parallel update: exact for large means, unlike sums of squares."""

    count: float = 0.0
    mean: np.ndarray | float = 0.0
    m2: np.ndarray | float = 0.0

    @classmethod
    def of(cls, values: np.ndarray) -> Moments:
        if len(values) == 0:
            return cls()
        mean = values.mean(axis=0)
        return cls(float(len(values)), mean, ((values - mean) ** 2).sum(axis=0))

    def add(self, count: float, mean: np.ndarray | float, m2: np.ndarray | float) -> None:
        if count == 0:
            return
        total = self.count + count
        delta = mean - self.mean
        self.mean = self.mean + delta * (count / total)
        self.m2 = self.m2 + m2 + delta**2 * (self.count * count / total)
        self.count = total

    def std(self) -> np.ndarray:
        return np.sqrt(np.asarray(self.m2) / max(self.count, 1.0))


@dataclass
class Statistics:
    """The first pass's per-batch statistics, combined in the driver."""

    width: int
    rows: np.ndarray = field(default_factory=lambda: np.zeros(3, np.int64))  # per split
    features: Moments = field(default_factory=Moments)  # of the training rows
    target: Moments = field(default_factory=Moments)  # regression: of the training targets
    labels: set[Any] = field(default_factory=set)

    def add(self, batch: dict[str, np.ndarray]) -> None:
        for index in range(len(batch["rows"])):
            self.rows += batch["rows"][index]
            train = float(batch["rows"][index][0])
            self.features.add(train, batch["mean"][index], batch["m2"][index])
            self.target.add(train, *batch["target"][index])
            self.labels.update(json.loads(str(batch["labels"][index])))
        if len(self.labels) > MAX_CLASSES:
            raise ConfigurationError(
                "data.task",
                f"the label column has more than {MAX_CLASSES} distinct values; if it is a "
                "number to predict, not a class, set --task regression",
            )

    def mean_std(self, normalize: bool) -> tuple[np.ndarray, np.ndarray]:
        if not normalize or self.features.count == 0:
            return np.zeros(self.width, np.float32), np.ones(self.width, np.float32)
        std = self.features.std()
        mean = np.asarray(self.features.mean)
        return mean.astype(np.float32), np.where(std < 1e-6, 1.0, std).astype(np.float32)

    def target_mean_std(self) -> tuple[float, float]:
        return float(self.target.mean), float(self.target.std()) or 1.0


def _batch_statistics(batch: pd.DataFrame, recipe: SplitRecipe) -> dict[str, np.ndarray]:
    labels = batch[recipe.label]
    missing = labels.isna().to_numpy()
    if recipe.task == "regression":
        import pandas as pd

        values = pd.to_numeric(labels, errors="coerce").to_numpy(np.float64)
        missing = missing | ~np.isfinite(values)
    if missing.any():
        where = batch["path"].to_numpy()[missing][0] if "path" in batch else "a file"
        raise ConfigurationError(
            "data.label_column",
            f"{int(missing.sum())} rows of {where} have no valid {recipe.label!r} "
            f"({'a number' if recipe.task == 'regression' else 'a label'}); drop or fill them",
        )
    split = recipe.splits(batch)
    train = split == 0
    features = Moments.of(batch[recipe.features].to_numpy(np.float64)[train])
    target = (
        Moments.of(labels.to_numpy(np.float64)[train]) if recipe.task == "regression" else Moments()
    )
    width = len(recipe.features)
    seen = [] if recipe.task == "regression" else sorted(labels.unique().tolist())
    return {
        "rows": np.bincount(split, minlength=3)[None],
        "mean": np.broadcast_to(features.mean, width)[None].astype(np.float64),
        "m2": np.broadcast_to(features.m2, width)[None].astype(np.float64),
        "target": np.array([[target.mean, target.m2]], np.float64),
        "labels": np.array([json.dumps(seen)]),
    }


def _batch_rows(
    batch: pd.DataFrame,
    recipe: SplitRecipe,
    mean: np.ndarray,
    std: np.ndarray,
    classes: list[Any],
) -> pyarrow.Table:
    import pandas as pd
    import pyarrow as pa

    features = ((batch[recipe.features].to_numpy(np.float32) - mean) / std).astype(np.float32)
    if recipe.task == "regression":
        labels = pa.array(batch[recipe.label].to_numpy(np.float32))
    else:
        labels = pa.array(pd.Categorical(batch[recipe.label], categories=classes).codes, pa.int64())
    names = np.array(SPLITS)[recipe.splits(batch)]
    flat = pa.array(features.reshape(-1))
    return pa.table(
        {
            _shards.FEATURES: pa.FixedSizeListArray.from_arrays(flat, features.shape[1]),
            _shards.LABEL: labels,
            "split": pa.array(names),
        }
    )


def read_source(source: _tabular_files.TabularSource, with_paths: bool = False) -> ray.data.Dataset:
    """The source files as a Ray Data dataset (see :func:`read_files`)."""
    return read_files(source.files, source.format, with_paths)


def read_files(
    files: list[_tabular_files.SourceFile],
    fmt: str,
    with_paths: bool = False,
    *,
    read_cpus: float | None = None,
    blocks: int | None = None,
    read_tasks: int | None = None,
) -> ray.data.Dataset:
    """``files`` (all ``fmt``: csv or parquet) as a Ray Data dataset, read through
    :mod:`integrations.storage`'s filesystem (its endpoint, credentials and retries).
    ``read_cpus``: what each read task reserves (Ray Data's default: 1); ``blocks``: how many
    blocks to read at least (Ray Data's default merges small files into few), as the v1 Parquet
    reader splits files; without it Parquet goes through Ray Data's default reader;
    ``read_tasks``: how many read tasks run at once at most (Ray Data's default: as many as fit)."""
    import ray.data

    located = [storage.ray_storage(f.url) for f in files]
    paths, filesystem = [path for path, _ in located], located[0][1]
    read = ray.data.read_parquet if fmt == "parquet" else ray.data.read_csv
    # No hive partition columns: the files' own columns are the schema described and checked.
    options: dict[str, Any] = {"partitioning": None, "include_paths": with_paths}
    if read_cpus is not None:
        options["num_cpus"] = read_cpus
    if blocks is not None:
        options["override_num_blocks"] = blocks
    if read_tasks is not None:
        options["concurrency"] = read_tasks
    context = ray.data.DataContext.get_current()
    datasource_v2 = context.use_datasource_v2
    # Ray 2.60's Parquet reader (datasource v2; the flag is read when the read is built) packs
    # files into 128 MiB read units and ignores the block count: 300,000 rows of 32 floats were
    # one block, which one actor downstream scored while the other idled. v1 splits as asked.
    context.use_datasource_v2 = datasource_v2 and blocks is None
    try:
        return read(paths, filesystem=filesystem, **options)
    finally:
        context.use_datasource_v2 = datasource_v2


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Raise a :class:`ConfigurationError` that a Ray Data task raised (bad rows of a file) as
    it is, not wrapped in Ray's task errors."""
    import ray.data

    context = ray.data.DataContext.get_current()
    raise_original = context.raise_original_map_exception
    context.raise_original_map_exception = True  # not Ray Data's UserCodeException around it
    try:
        yield
    except Exception as exc:
        if type(exc) is ConfigurationError:
            raise
        cause: BaseException | None = exc
        while cause is not None and not isinstance(cause, ConfigurationError):
            cause = getattr(cause, "cause", None) or cause.__cause__ or cause.__context__
        if cause is None:
            raise
        raise ConfigurationError(cause.field, cause.message) from None
    finally:
        context.raise_original_map_exception = raise_original


@dataclass(frozen=True)
class StreamedSplits:
    """What preparing wrote: per split its files and rows; the classes and target scale."""

    files: dict[str, list[_shards.ShardFile]]
    class_names: list[str]
    target_mean: float
    target_std: float

    @property
    def rows(self) -> dict[str, int]:
        return {split: sum(f.rows for f in listed) for split, listed in self.files.items()}


def prepare(
    source: _tabular_files.TabularSource,
    recipe: SplitRecipe,
    splits_url: str,
    *,
    normalize: bool,
    standardize_target: bool,
) -> StreamedSplits:
    """Split, standardise and write ``source`` as Parquet shards under ``splits_url``."""
    from rich.progress import Progress

    statistics = Statistics(width=len(recipe.features))
    with Progress(transient=True) as progress, user_errors():  # a dataset keeps its context
        first_pass = read_source(source, with_paths=True).map_batches(
            functools.partial(_batch_statistics, recipe=recipe),
            batch_format="pandas",
            batch_size=BATCH_ROWS,
        )
        rows = progress.add_task("Split statistics", total=source.rows)
        for batch in first_pass.iter_batches(batch_size=None, batch_format="numpy"):
            statistics.add(batch)
            progress.update(rows, advance=int(batch["rows"].sum()))
    mean, std = statistics.mean_std(normalize)
    classes = sorted(statistics.labels)
    target_mean, target_std = (
        statistics.target_mean_std()
        if recipe.task == "regression" and standardize_target
        else (0.0, 1.0)
    )
    output = storage.split_parquet_url(splits_url)
    fs, path = storage.filesystem(output)
    if fs.exists(path):  # a crashed earlier write: its files must not join this one's
        fs.rm(path, recursive=True)
    row_bytes = 4 * len(recipe.features) + 16
    out_path, out_fs = storage.ray_storage(output)
    read_source(source).map_batches(
        functools.partial(_batch_rows, recipe=recipe, mean=mean, std=std, classes=classes),
        batch_format="pandas",
        batch_size=BATCH_ROWS,
    ).write_parquet(
        out_path,
        filesystem=out_fs,
        partition_cols=["split"],
        max_rows_per_file=max(BATCH_ROWS, FILE_BYTES // row_bytes),
        row_group_size=max(1024, ROW_GROUP_BYTES // row_bytes),
    )
    files = {split: _written(splits_url, split) for split in SPLITS}
    for split, listed in files.items():
        if not listed:
            raise ConfigurationError(
                "data.val_fraction" if split == "val" else "data.test_fraction",
                f"the {split} split of {source.url} is empty ({source.rows} rows); raise its "
                "fraction or give more rows",
            )
    _shards.write_manifest(splits_url, files)
    storage.write_array(storage.statistic_url(splits_url, "mean"), mean)
    storage.write_array(storage.statistic_url(splits_url, "std"), std)
    return StreamedSplits(files, [str(c) for c in classes], target_mean, target_std)


def _written(splits_url: str, split: str) -> list[_shards.ShardFile]:
    """The files the write pass left in ``split``'s folder, with their rows (from footers)."""
    folder = storage.join(storage.split_parquet_url(splits_url), f"split={split}")
    try:
        written = _tabular_files.describe_files(folder)
    except ConfigurationError:  # no file: an empty split
        return []
    base = storage.filesystem(splits_url)[1].rstrip("/") + "/"
    return [
        _shards.ShardFile(storage.filesystem(f.url)[1].removeprefix(base), f.row_groups)
        for f in written
    ]
