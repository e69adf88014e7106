"""Batch scoring: a registered model version over a tabular dataset's files, on Ray Data.

Rows are raw features, as ``/predict`` takes them: for a model that names its features, those
columns; for one that does not, every numeric column in order. The other columns pass through
to the output next to ``prediction`` (the class name, or the value) and, for a classifier,
``probabilities``. Ray Data reads the files, actors (:class:`BatchScorer`) that each load the
model once score batches, and the rows are written as Parquet under the output URL; the driver
never holds rows.

An output folder is complete only once its manifest (``_SUCCESS``, JSON) is written, after
every Parquet file; a ``_PENDING`` marker written first names the write, whose files carry its
id. Clearing a folder removes only the files that a manifest bound to the folder lists (at the
sizes it recorded) or that the pending write named, and refuses a folder holding any other file:
a Spark job's ``_SUCCESS``, or another scoring's output, is never ours to delete.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
from pydantic import BaseModel, Field, ValidationError

from prefect_ml.integrations import datasets, storage
from prefect_ml.integrations.config import PredictParams
from prefect_ml.integrations.errors import ConfigurationError
from prefect_ml.integrations.serving import _inference, _models

if TYPE_CHECKING:
    import pyarrow

PREDICTION, PROBABILITIES = "prediction", "probabilities"
FINGERPRINT_CHARS = 24
# What each read and write task reserves: they are light next to the model, and actors that
# hold every CPU would leave them none, so the pipeline would stall (2 actors of 1 CPU on 2 cores
# do). Ray Data's default of 1 CPU per write task made writes wait for reads to finish.
IO_CPUS = 0.25
# Read and write tasks in flight: one of each per this many actors. Each more is a worker process
# that starts (seconds on a busy host) and takes CPU from the model: 1M rows of a light model on
# 2 cores took 13-15 s with one of each, 20-31 s with as many as Ray Data fits (0.25 CPU each).
ACTORS_PER_IO_TASK = 2
# Blocks are the unit an actor takes: small enough that an actor ready seconds after the other
# (each loads the model) still gets its share, and the last block is a short tail.
BLOCKS_PER_ACTOR = 16


@dataclass(frozen=True)
class ScoringColumns:
    """Which input columns the model takes (in its order) and which pass through."""

    features: list[str]
    passthrough: list[str]


class PredictionManifest(BaseModel):
    """What a batch scoring wrote, recorded after its last Parquet file (its commit marker)."""

    fingerprint: str
    model_name: str
    model_version: str
    run_id: str
    model_uri: str
    input_url: str
    inputs: list[str]
    output_url: str
    files: list[str]
    sizes: list[int] = []  # bytes of each of ``files``, as written
    rows: int
    seconds: float
    created: str
    feature_columns: list[str]
    passthrough_columns: list[str]

    @property
    def rows_per_second(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else 0.0


def scoring_columns(file: datasets.SourceFile, served: _models.ServedModel) -> ScoringColumns:
    """The feature and passthrough columns of ``file`` for ``served``.

    Raises:
        ConfigurationError: naming ``url``: a feature column the model names is missing or not
            numeric, the numeric columns do not match an unnamed model's width, or a column
            would be overwritten by an output column.
    """
    types = datasets.column_types(file)
    what = f"{served.name} v{served.version}"
    if served.feature_names:
        missing = [name for name in served.feature_names if name not in types]
        if missing:
            raise ConfigurationError(
                "url",
                f"{file.url} has no column {', '.join(map(repr, missing))} that {what} takes "
                f"as features; its columns are {list(types)}",
            )
        features = list(served.feature_names)
    else:
        features = [c for c, t in types.items() if t.startswith(datasets.NUMERIC_TYPES)]
        if len(features) != served.width:
            raise ConfigurationError(
                "url",
                f"{file.url} has {len(features)} numeric columns {features}, but {what} takes "
                f"{served.width} features (it names none, so every numeric column is one, in "
                "order); drop or encode columns until they match",
            )
    text = [c for c in features if not types[c].startswith((*datasets.NUMERIC_TYPES, "null"))]
    if text:
        raise ConfigurationError(
            "url", f"feature columns {text} of {file.url} are not numeric; encode them"
        )
    passthrough = [c for c in types if c not in features]
    clash = [c for c in passthrough if c in (PREDICTION, PROBABILITIES)]
    if clash:
        raise ConfigurationError(
            "url", f"{file.url} has columns {clash}, which the output writes; rename them"
        )
    return ScoringColumns(features, passthrough)


def fingerprint(files: list[datasets.SourceFile], served: _models.ServedModel) -> str:
    """The identity of a scoring: the input files (URL, size, version) and the model version."""
    identity = {
        "files": datasets.files_digest(files),
        "model": served.name,
        "version": served.version,
    }
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    return digest[:FINGERPRINT_CHARS]


def feature_matrix(batch: pyarrow.Table, names: list[str]) -> np.ndarray:
    """The named columns of ``batch`` as a float32 matrix, nulls as NaN."""
    matrix = np.empty((batch.num_rows, len(names)), dtype=np.float32)
    for index, name in enumerate(names):
        matrix[:, index] = batch.column(name).to_numpy()
    return matrix


def scored_table(
    batch: pyarrow.Table,
    passthrough: list[str],
    outputs: np.ndarray,
    class_names: list[str] | None,
    task: str,
) -> pyarrow.Table:
    """The passthrough columns of ``batch``, ``prediction`` and, for a classifier,
    ``probabilities`` (a list of float32 per row)."""
    import pyarrow as pa

    columns: dict[str, Any] = {name: batch.column(name) for name in passthrough}
    columns[PREDICTION] = pa.array(_models.labelled_outputs(outputs, class_names, task))
    if task != "regression":
        flat = pa.array(outputs.astype(np.float32).reshape(-1))
        fixed = pa.FixedSizeListArray.from_arrays(flat, outputs.shape[1])
        columns[PROBABILITIES] = fixed.cast(pa.list_(pa.float32()))
    return pa.table(columns)


class BatchScorer:
    """A Ray Data actor: the version's model, loaded once, scoring batches of raw rows."""

    def __init__(
        self,
        served: dict[str, Any],
        columns: dict[str, Any],
        gpus: float,
        precision: _inference.InferencePrecision,
        threads: int,
    ) -> None:
        import torch

        torch.set_num_threads(threads)
        self.served = _models.ServedModel.model_validate(served)
        self.columns = ScoringColumns(**columns)
        self.predictor, _ = _models.load_predictor(self.served, gpus, precision)

    def __call__(self, batch: pyarrow.Table) -> pyarrow.Table:
        matrix = feature_matrix(batch, self.columns.features)
        bad = _models.non_finite_rows(matrix)
        if bad:
            row = {name: batch.column(name)[bad[0]].as_py() for name in self.columns.features}
            raise ConfigurationError(
                "url",
                f"{len(bad)} rows of a batch have missing or non-finite features, e.g. {row}; "
                "fill or drop them",
            )
        outputs = self.predictor.outputs(matrix)
        if bad := _models.non_finite_rows(outputs):
            raise ConfigurationError(
                "model_version",
                f"{self.served.name} v{self.served.version} returned non-finite outputs for "
                f"{len(bad)} rows of finite features; check the model",
            )
        return scored_table(
            batch, self.columns.passthrough, outputs, self.served.class_names, self.served.task
        )


Marker = TypeVar("Marker", bound=BaseModel)


class PendingWrite(BaseModel):
    """The marker written before a scoring's first file: its files' names start with its id."""

    fingerprint: str
    write_id: str = Field(pattern=r"^[0-9a-f]{32}$")

    def wrote(self, name: str) -> bool:
        return name.startswith(f"{self.write_id}_") and name.endswith(".parquet")


def _read_marker(url: str, model: type[Marker]) -> Marker | None:
    """The marker at ``url`` if it is one of ours; None when absent or anything else."""
    if not storage.exists(url):
        return None
    try:
        return model.model_validate_json(storage.read_bytes(url))
    except ValidationError:
        return None


def completed(output_url: str, fingerprint: str) -> PredictionManifest | None:
    """The manifest of a complete scoring with ``fingerprint`` at ``output_url``, else None."""
    manifest = _read_marker(storage.predictions_manifest_url(output_url), PredictionManifest)
    if manifest is None or manifest.output_url != output_url:
        return None
    return manifest if manifest.fingerprint == fingerprint else None


def _ours(output_url: str, sizes: dict[str, int]) -> set[str]:
    """Names of the files under ``output_url`` that an earlier scoring wrote there: those its
    manifest (bound to this folder) lists at the sizes it recorded, or a crashed write's."""
    ours: set[str] = set()
    manifest_url = storage.predictions_manifest_url(output_url)
    manifest = _read_marker(manifest_url, PredictionManifest)
    if manifest is not None and manifest.output_url == output_url:
        written = {
            url.rsplit("/", 1)[-1]: (url, size)
            for url, size in zip(manifest.files, manifest.sizes, strict=False)
        }
        if len(written) == len(manifest.files) and all(
            sizes.get(name, size) == size  # gone already: an interrupted clear
            and storage.is_within(url, storage.join(output_url, name))
            for name, (url, size) in written.items()
        ):
            ours |= (written.keys() & sizes.keys()) | {manifest_url.rsplit("/", 1)[-1]}
    pending_url = storage.predictions_pending_url(output_url)
    pending = _read_marker(pending_url, PendingWrite)
    if pending is not None:
        ours |= {name for name in sizes if pending.wrote(name)}
        ours.add(pending_url.rsplit("/", 1)[-1])
    return ours


def check_output(output_url: str) -> set[str]:
    """The names of the files an earlier scoring (complete or crashed) left at ``output_url``;
    an error if the folder holds any other.

    Raises:
        ConfigurationError: naming ``output``: the folder holds files no scoring wrote there.
    """
    names = storage.list_names(output_url)
    ours = _ours(output_url, storage.list_sizes(output_url)) if names else set()
    foreign = [name for name in names if name not in ours]
    if foreign:
        raise ConfigurationError(
            "output",
            f"{output_url} holds files that no batch scoring wrote there ({foreign[:5]}); give "
            "an empty or new folder",
        )
    return ours


def clear_output(output_url: str) -> None:
    """Remove an earlier scoring's files and nothing else (:func:`check_output`); its data
    files first, its markers last, so an interrupted clear is cleared by the next."""
    for name in sorted(check_output(output_url), key=lambda name: name.startswith("_")):
        storage.remove(storage.join(output_url, name))


def scorer_arguments(
    served: _models.ServedModel, columns: ScoringColumns, options: PredictParams
) -> dict[str, Any]:
    """Each scoring actor's constructor arguments, as Ray Data records and pickles them: the
    version, the columns, and the device, precision and threads the predict section sets."""
    return {
        "served": served.model_dump(),
        "columns": asdict(columns),
        "gpus": 1.0 if options.use_gpu else 0.0,
        "precision": options.inference_precision,
        "threads": max(1, int(options.cpus_per_actor)),
    }


def score(
    input_url: str,
    files: list[datasets.SourceFile],
    served: _models.ServedModel,
    columns: ScoringColumns,
    output_url: str,
    options: PredictParams,
) -> PredictionManifest:
    """Score ``files`` (those at ``input_url``, one format) with ``served`` on Ray Data into
    Parquet under ``output_url`` (cleared first), then write the manifest; returns it. The
    predict section says how the actors run: rows per batch, how many, what each reserves."""
    key = fingerprint(files, served)
    fmt = datasets.file_format(files[0].url) or "csv"
    clear_output(output_url)
    pending = PendingWrite(fingerprint=key, write_id=uuid.uuid4().hex)
    storage.write_bytes(
        storage.predictions_pending_url(output_url), pending.model_dump_json().encode()
    )
    started = time.perf_counter()
    scorer_options = scorer_arguments(served, columns, options)
    _write_scored(files, fmt, scorer_options, output_url, options, pending.write_id)
    seconds = time.perf_counter() - started
    written = _written(output_url)
    manifest = PredictionManifest(
        fingerprint=key,
        model_name=served.name,
        model_version=served.version,
        run_id=served.run_id,
        model_uri=served.uri,
        input_url=input_url,
        inputs=[f.url for f in files],
        output_url=output_url,
        files=[f.url for f in written],
        sizes=[f.size for f in written],
        rows=sum(f.rows for f in written),
        seconds=seconds,
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        feature_columns=columns.features,
        passthrough_columns=columns.passthrough,
    )
    storage.write_bytes(
        storage.predictions_manifest_url(output_url), manifest.model_dump_json(indent=1).encode()
    )
    storage.remove(storage.predictions_pending_url(output_url))
    return manifest


def _write_scored(
    files: list[datasets.SourceFile],
    fmt: str,
    scorer_options: dict[str, Any],
    output_url: str,
    options: PredictParams,
    write_id: str,
) -> None:
    """Read ``files`` with Ray Data, score them on a pool of :class:`BatchScorer` actors and
    write Parquet files named ``<write_id>_*`` under ``output_url``."""
    import ray.data
    from ray.data.datasource import FilenameProvider

    path, filesystem = storage.ray_storage(output_url)
    # Every actor gets work: a few blocks each at least, however few and small the files are.
    rows = sum(f.rows for f in files)
    blocks = max(
        len(files), min(BLOCKS_PER_ACTOR * options.concurrency, -(-rows // options.batch_size))
    )
    io_tasks = -(-options.concurrency // ACTORS_PER_IO_TASK)
    with datasets.user_errors():
        read = datasets.read_files(
            files, fmt, read_cpus=IO_CPUS, blocks=blocks, read_tasks=io_tasks
        )
        read.map_batches(
            BatchScorer,
            fn_constructor_kwargs=scorer_options,
            batch_format="pyarrow",
            batch_size=options.batch_size,
            compute=ray.data.ActorPoolStrategy(size=options.concurrency),
            num_cpus=options.cpus_per_actor,
            num_gpus=scorer_options["gpus"] or None,
        ).write_parquet(
            path,
            filesystem=filesystem,
            ray_remote_args={"num_cpus": IO_CPUS},
            concurrency=io_tasks,
            filename_provider=FilenameProvider(write_id, "parquet"),
        )


def _written(output_url: str) -> list[datasets.SourceFile]:
    """The Parquet files the write left under ``output_url`` (none for an empty input)."""
    try:
        return datasets.describe_files(output_url, "output")
    except ConfigurationError:
        return []
