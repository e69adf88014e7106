"""Streamed data: tabular files described from metadata and refused before any training when
they disagree, splits prepared by Ray Data (seeded, disjoint, standardised), workers streaming
their equal share in a repeatable order, from S3 under injected faults, and a worker killed
mid-epoch that resumes on the same rows in the same order."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from prefect_ml.integrations import datasets, storage
from prefect_ml.integrations.config.loop import TrainLoop
from prefect_ml.integrations.datasets import _streaming
from prefect_ml.integrations.errors import ConfigurationError
from prefect_ml.integrations.training import (
    EpochCommitter,
    EpochTrainer,
    load_trained_model,
)
from prefect_ml.tasks.data import (
    PreparedData,
    fingerprint_source,
    inspect_dataset,
    preprocess_streamed,
)
from prefect_ml.tasks.params import DataParams, TrainModelParams
from tests.s3 import FaultyProxy, MotoS3

FEATURES = 6
ROWS_PER_FILE = 1500


def learnable_rows(files: int = 3, seed: int = 0) -> pd.DataFrame:
    """Rows a model can learn: the label is the largest of 3 columns, and column ``f0`` holds
    each row's id (to check that splits cover every row once)."""
    x = np.random.default_rng(seed).standard_normal((files * ROWS_PER_FILE, FEATURES))
    frame = pd.DataFrame(x.astype(np.float32), columns=[f"f{j}" for j in range(FEATURES)])
    frame["f0"] = np.arange(len(frame), dtype=np.float32)
    frame["kind"] = np.array(["low", "mid", "top"])[x[:, 1:4].argmax(axis=1)]
    return frame


def write_parquet_files(folder: Path, files: int = 3, seed: int = 0) -> pd.DataFrame:
    """:func:`learnable_rows` as ``files`` Parquet files of ``ROWS_PER_FILE`` rows."""
    folder.mkdir(parents=True, exist_ok=True)
    frame = learnable_rows(files, seed)
    for index in range(files):
        part = frame.iloc[index * ROWS_PER_FILE : (index + 1) * ROWS_PER_FILE]
        part.to_parquet(folder / f"part-{index}.parquet", index=False)
    return frame


def data_params(url: str) -> DataParams:
    return DataParams(dataset="tabular", url=url, label_column="kind")


def prepare(source_url: str, storage_url: str) -> PreparedData:
    data = data_params(source_url)
    source = datasets.describe_source(source_url, "kind")
    return preprocess_streamed(data, source, fingerprint_source(source, data), storage_url)


@pytest.fixture(scope="module")
def source_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("streamed") / "source"
    write_parquet_files(folder)
    return folder


@pytest.fixture(scope="module")
def streamed(ray_cluster: None, source_folder: Path) -> PreparedData:
    """One streamed dataset prepared by Ray Data for the module's tests."""
    return prepare(str(source_folder), (source_folder.parent / "storage").as_uri())


def place(features: np.ndarray, labels: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.from_numpy(features), torch.from_numpy(labels.astype(np.int64))


def row_ids(data: PreparedData, features: np.ndarray) -> np.ndarray:
    """The source row ids of standardised rows (column f0 undone)."""
    mean = storage.read_array(storage.statistic_url(data.splits_url, "mean"))
    std = storage.read_array(storage.statistic_url(data.splits_url, "std"))
    return np.rint(features[:, 0] * std[0] + mean[0]).astype(np.int64)


def epoch_rows(shard: datasets.Shard, data: PreparedData, epoch: int | None) -> list[int]:
    order = datasets.EpochOrder(seed=7, epoch=epoch, rank=0) if epoch else None
    return [int(i) for f, _ in shard.batches(50, order, place) for i in row_ids(data, f.numpy())]


# --- described from metadata, refused before training ------------------------------------


def test_files_are_described_from_footers_and_their_identity_follows_each_file(
    tmp_path: Path,
) -> None:
    write_parquet_files(tmp_path / "data")
    source = datasets.describe_source(str(tmp_path / "data"), "kind")
    assert [Path(f.url).name for f in source.files] == [f"part-{i}.parquet" for i in range(3)]
    assert source.rows == 3 * ROWS_PER_FILE
    assert source.feature_columns == [f"f{j}" for j in range(FEATURES)]
    glob = datasets.describe_source(str(tmp_path / "data" / "part-[01].parquet"), "kind")
    assert glob.rows == 2 * ROWS_PER_FILE
    before = source.identity()
    write_parquet_files(tmp_path / "data", files=1, seed=1)  # part-0 rewritten: other bytes
    assert datasets.describe_source(str(tmp_path / "data"), "kind").identity() != before


def test_csv_files_are_counted_without_loading_them(tmp_path: Path) -> None:
    (tmp_path / "csv").mkdir()
    for index in range(2):
        frame = pd.DataFrame({"a": [1.0, 2.0, 3.0], "kind": ["x", "y", "x"]})
        text = frame.to_csv(index=False)
        (tmp_path / "csv" / f"{index}.csv").write_text(text if index else text.rstrip("\n"))
    source = datasets.describe_source(str(tmp_path / "csv"), "kind")
    assert source.format == "csv" and source.rows == 6 and source.feature_columns == ["a"]


def test_a_url_matching_no_file_is_refused_naming_it(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("not data")
    for url in (str(tmp_path / "empty"), str(tmp_path / "missing" / "*.parquet")):
        with pytest.raises(ConfigurationError, match="matches no CSV or Parquet file") as refused:
            datasets.describe_source(url, "kind")
        assert refused.value.field == "data.url" and url in str(refused.value)


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        (lambda f: f.assign(f1=f["f1"].astype(str)), "data.url", "other columns than"),
        (lambda f: f.drop(columns=["kind"]), "data.label_column", "'kind' is not in"),
        (lambda f: f.assign(extra=1.0), "data.url", "other columns than"),
    ],
    ids=["other-type", "no-label", "extra-column"],
)
def test_a_file_that_differs_from_the_others_fails_before_training_naming_it(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    change: Callable[[pd.DataFrame], pd.DataFrame],
    field: str,
    words: str,
) -> None:
    write_parquet_files(tmp_path / "data")
    odd = tmp_path / "data" / "part-1.parquet"
    change(pd.read_parquet(odd)).to_parquet(odd, index=False)
    monkeypatch.setenv("PREFECT_ML_DATA_LAYOUT", "parquet")
    params = TrainModelParams(
        data={"dataset": "tabular", "url": str(tmp_path / "data"), "label_column": "kind"}
    )
    with pytest.raises(ConfigurationError, match=words) as refused:
        inspect_dataset(params)  # the first step of every flow
    assert refused.value.field == field and "part-1.parquet" in str(refused.value)


# --- prepared by Ray Data -----------------------------------------------------------------


def test_streaming_statistics_combine_batches_exactly_even_far_from_zero() -> None:
    """Chan's update of per-batch moments: a column around 1e9 keeps its unit deviation (sums
    of squares in float64 would lose it)."""
    values = 1e9 + np.random.default_rng(3).standard_normal((10_000, 2))
    combined = datasets.Moments()
    for batch in np.array_split(values, 7):
        part = datasets.Moments.of(batch)
        combined.add(part.count, part.mean, part.m2)
    np.testing.assert_allclose(combined.mean, values.mean(axis=0), rtol=1e-13)
    np.testing.assert_allclose(combined.std(), values.std(axis=0), rtol=1e-6)


def test_a_rows_split_depends_on_its_values_only_not_on_its_batch_or_position() -> None:
    frame = learnable_rows()
    recipe = datasets.SplitRecipe(
        features=[f"f{j}" for j in range(FEATURES)],
        label="kind",
        task="classification",
        seed=4,
        val_fraction=0.15,
        test_fraction=0.15,
    )
    whole = recipe.splits(frame)
    parts = [frame.iloc[start : start + 700] for start in range(0, len(frame), 700)]
    assert np.array_equal(np.concatenate([recipe.splits(part) for part in parts]), whole)
    shuffled = frame.sample(frac=1.0, random_state=1)
    assert np.array_equal(recipe.splits(shuffled), whole[shuffled.index.to_numpy()])
    other_seed = datasets.SplitRecipe(**{**recipe.__dict__, "seed": 5})
    assert not np.array_equal(other_seed.splits(frame), whole)


def test_rows_without_a_label_fail_the_preparation_naming_their_file(
    ray_cluster: None, tmp_path: Path
) -> None:
    write_parquet_files(tmp_path / "source")
    odd = tmp_path / "source" / "part-2.parquet"
    frame = pd.read_parquet(odd)
    frame.loc[frame.index[:4], "kind"] = None  # the same columns and types, four labels missing
    frame.to_parquet(odd, index=False)
    with pytest.raises(ConfigurationError, match="4 rows of .*part-2.parquet have no valid") as bad:
        prepare(str(tmp_path / "source"), (tmp_path / "storage").as_uri())
    assert bad.value.field == "data.label_column"
    assert not list(tmp_path.rglob("meta.json")), "nothing half-prepared is left to be reused"


def test_a_streamed_regression_target_is_standardised_by_its_training_rows(
    ray_cluster: None, tmp_path: Path
) -> None:
    frame = write_parquet_files(tmp_path / "source", files=2).drop(columns=["kind"])
    frame["price"] = 3.0 * frame["f1"] + 50.0
    frame.iloc[:1500].to_parquet(tmp_path / "source" / "part-0.parquet", index=False)
    frame.iloc[1500:].to_parquet(tmp_path / "source" / "part-1.parquet", index=False)
    data = DataParams(
        dataset="tabular", url=str(tmp_path / "source"), label_column="price", task="regression"
    )
    source = datasets.describe_source(data.url or "", "price", "regression")
    prepared = preprocess_streamed(
        data, source, fingerprint_source(source, data), (tmp_path / "storage").as_uri()
    )
    assert prepared.task == "regression" and prepared.num_classes == 1
    _, targets = prepared.shard("train").head(10**6)
    assert prepared.target_mean == pytest.approx(float(targets.mean()), rel=1e-6)
    assert prepared.target_std == pytest.approx(float(targets.std()), rel=1e-4)
    assert abs(prepared.target_mean - 50.0) < 0.5  # the raw targets are stored, not scaled


def test_streamed_splits_are_seeded_disjoint_complete_and_standardised(
    streamed: PreparedData, source_folder: Path, tmp_path: Path
) -> None:
    assert streamed.layout == "parquet" and streamed.class_names == ["low", "mid", "top"]
    rows = {
        split: np.sort(row_ids(streamed, streamed.shard(split).head(10**6)[0]))
        for split in ("train", "val", "test")
    }
    every = np.concatenate(list(rows.values()))
    assert np.array_equal(np.sort(every), np.arange(3 * ROWS_PER_FILE)), "each row once"
    assert streamed.rows == {split: len(ids) for split, ids in rows.items()}
    assert abs(streamed.rows["test"] / len(every) - 0.15) < 0.03
    features, labels = streamed.shard("train").head(10**6)
    assert np.abs(features[:, 1:].mean(axis=0)).max() < 1e-4
    assert np.abs(features[:, 1:].std(axis=0) - 1).max() < 1e-3
    assert set(np.unique(labels)) == {0, 1, 2}
    again = prepare(str(source_folder), (tmp_path / "other").as_uri())
    assert again.fingerprint == streamed.fingerprint
    for split, ids in rows.items():  # the same rows in each split, prepared again elsewhere
        assert np.array_equal(np.sort(row_ids(again, again.shard(split).head(10**6)[0])), ids)


def test_a_worker_streams_its_equal_share_in_a_repeatable_seeded_order(
    streamed: PreparedData,
) -> None:
    world = [
        datasets.open_shard(streamed.splits_url, "parquet", "train", (FEATURES,), rank, 2)
        for rank in range(2)
    ]
    for shard in world:
        assert isinstance(shard, datasets.StreamedShard)
        shard.window_rows = 300  # several shuffle windows per epoch
    orders = [epoch_rows(world[0], streamed, 1), epoch_rows(world[1], streamed, 1)]
    assert len(orders[0]) == len(orders[1]) == streamed.rows["train"] // 2
    assert not set(orders[0]) & set(orders[1]), "the workers' shares are disjoint"
    assert epoch_rows(world[0], streamed, 1) == orders[0], "an epoch's order is repeatable"
    second = epoch_rows(world[0], streamed, 2)
    assert second != orders[0], "each epoch is shuffled anew"
    in_order = epoch_rows(world[0], streamed, None)  # validation: as stored, every time
    assert in_order == epoch_rows(world[0], streamed, None) and in_order != orders[0]
    assert set(in_order) == set(orders[0])


def test_sorted_source_files_still_give_mixed_batches(
    ray_cluster: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Files sorted by label (a table dumped by class): row groups from across the split meet
    in every shuffle window, so batches mix the classes."""
    frame = write_parquet_files(tmp_path / "source", files=4)
    for index in (2, 3):
        (tmp_path / "source" / f"part-{index}.parquet").unlink()
    ordered = frame.sort_values("kind", kind="stable")
    half = len(frame) // 2
    for index, part in enumerate((ordered.iloc[:half], ordered.iloc[half:])):
        part.to_parquet(tmp_path / "source" / f"part-{index}.parquet", index=False)
    monkeypatch.setattr(_streaming, "ROW_GROUP_BYTES", 4096)  # row groups of 1024 rows
    data = prepare(str(tmp_path / "source"), (tmp_path / "storage").as_uri())
    shard = data.shard("train")
    assert isinstance(shard, datasets.StreamedShard)
    assert sum(len(f.groups) for f in shard.files) >= 4
    shard.window_rows = 2048  # two row groups per window
    batches = [labels for _, labels in shard.batches(64, datasets.EpochOrder(1, 1, 0), place)]
    mixed = [len(torch.unique(labels)) > 1 for labels in batches]
    assert sum(mixed) / len(mixed) > 0.6, "most batches hold more than one class"


def test_a_shard_file_that_changed_under_the_run_is_refused(
    streamed: PreparedData, tmp_path: Path
) -> None:
    listed = datasets.read_manifest(streamed.splits_url)["val"]
    copy = tmp_path / "splits"
    source = Path(streamed.splits_url.removeprefix("file://"))
    for file in listed:
        target = copy / file.name
        target.parent.mkdir(parents=True, exist_ok=True)
        table = pq.read_table(source / file.name)
        pq.write_table(table.slice(0, table.num_rows - 5), target)  # truncated by 5 rows
    datasets.write_manifest(copy.as_uri(), {"val": listed})
    shard = datasets.open_shard(copy.as_uri(), "parquet", "val", (FEATURES,))
    with pytest.raises(datasets.ShardReadError, match="where its manifest says"):
        list(shard.batches(64, None, place))


def test_a_shard_whose_columns_are_not_plain_floats_is_refused_before_decoding(
    tmp_path: Path,
) -> None:
    """A planted shard with a binary ``features`` column (an extension type's storage, e.g. Ray's
    pickled objects) is refused from its schema: no decoder named by a file runs."""
    table = pa.table({"features": pa.array([b"\x80\x04K\x01."] * 3), "label": pa.array([0, 1, 2])})
    (tmp_path / "parquet").mkdir()
    pq.write_table(table, tmp_path / "parquet" / "planted.parquet")
    datasets.write_manifest(
        tmp_path.as_uri(), {"train": [datasets.ShardFile("parquet/planted.parquet", (3,))]}
    )
    shard = datasets.open_shard(tmp_path.as_uri(), "parquet", "train", (FEATURES,))
    with pytest.raises(datasets.ShardReadError, match="not the fixed-size float32 lists"):
        list(shard.batches(2, None, place))


def test_a_label_column_of_objects_is_refused(tmp_path: Path) -> None:
    table = pa.table({"f0": pa.array([1.0, 2.0]), "kind": pa.array([b"a", b"b"])})
    (tmp_path / "data").mkdir()
    pq.write_table(table, tmp_path / "data" / "part-0.parquet")
    with pytest.raises(ConfigurationError, match="a label must be a number") as refused:
        datasets.describe_source(str(tmp_path / "data"), "kind")
    assert refused.value.field == "data.label_column" and "part-0.parquet" in str(refused.value)


# --- S3 faults ----------------------------------------------------------------------------


def _put_shards(bucket: str, data: PreparedData) -> str:
    """The training split's shards copied to S3 (past any proxy), with their manifest."""
    target = storage.join(bucket, "splits")
    listed = datasets.read_manifest(data.splits_url)["train"]
    for file in listed:
        payload = storage.read_bytes(storage.join(data.splits_url, file.name))
        storage.write_bytes(storage.join(target, file.name), payload)
    datasets.write_manifest(target, {"train": listed})
    return target


def _small_windows(splits_url: str) -> datasets.StreamedShard:
    shard = datasets.open_shard(splits_url, "parquet", "train", (FEATURES,))
    assert isinstance(shard, datasets.StreamedShard)
    shard.window_rows = 300  # several shuffle windows per epoch
    return shard


@pytest.mark.parametrize(
    ("attempts", "rate"),
    [pytest.param(6, 0.15, id="retried-15pct"), pytest.param(1, 0.4, id="no-retries-40pct")],
)
def test_streaming_from_s3_rides_out_faults_and_never_trains_on_a_partial_shard(
    streamed: PreparedData,
    s3_bucket: str,
    moto_s3: MotoS3,
    monkeypatch: pytest.MonkeyPatch,
    attempts: int,
    rate: float,
) -> None:
    from s3fs import S3FileSystem

    url = _put_shards(s3_bucket, streamed)
    expected = epoch_rows(_small_windows(streamed.splits_url), streamed, 3)
    monkeypatch.setenv("PREFECT_ML_S3_MAX_ATTEMPTS", str(attempts))
    outcomes = []
    with FaultyProxy(moto_s3.port, rate=rate, seed=attempts) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        S3FileSystem.clear_instance_cache()
        for _ in range(4):
            try:
                outcomes.append(epoch_rows(_small_windows(url), streamed, 3))
            except Exception as exc:  # failing is allowed; training on part of it is not
                outcomes.append(type(exc).__name__)
    S3FileSystem.clear_instance_cache()
    assert proxy.slow_downs + proxy.resets > 0, "the proxy injected no faults"
    for outcome in outcomes:
        assert outcome == expected or isinstance(outcome, str), "a partial or reordered epoch"
    if attempts > 1:
        assert all(outcome == expected for outcome in outcomes), outcomes
    else:
        assert any(isinstance(outcome, str) for outcome in outcomes), "40% faults never failed"


# --- a worker killed mid-epoch ------------------------------------------------------------


def _config(data: PreparedData, checkpoint_url: str, epochs: int) -> TrainLoop:
    return TrainLoop.from_options(
        splits_url=data.splits_url,
        sample_shape=data.sample_shape,
        num_classes=data.num_classes,
        model="mlp",
        model_options={"hidden": 16, "depth": 1, "dropout": 0.1},
        epochs=epochs,
        batch_size=64,
        lr=0.01,
        optimizer="adam",
        weight_decay=0.0,
        scheduler="none",
        seed=5,
        checkpoint_url=checkpoint_url,
        layout="parquet",
    )


def _train(config: TrainLoop, die_in_epoch: int, log: str) -> None:
    """A worker process: train from the last checkpoint, logging each batch's first row id;
    with ``die_in_epoch``, killed (no clean-up at all) after 3 batches of that epoch."""
    trainer = EpochTrainer(config)
    assert isinstance(trainer.train, datasets.StreamedShard)
    trainer.train.window_rows = 400
    committer = EpochCommitter(trainer.store)
    epoch, batches = 0, 0
    on_device = trainer._on_device

    def logged(features: np.ndarray, labels: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        nonlocal batches
        if features.shape[0] == 64:  # a training batch (validation batches are 256)
            with open(log, "a") as out:
                out.write(f"{epoch} {features[0, 0]:.6f}\n")
            batches += 1
            if epoch == die_in_epoch and batches == 3:
                os._exit(9)
        return on_device(features, labels)

    trainer._on_device = logged  # type: ignore[method-assign]
    for epoch in range(trainer.first_epoch, trainer.config.training.epochs + 1):
        batches = 0
        metrics = trainer.train_epoch(epoch)
        committer.submit(epoch, trainer.snapshot(epoch), metrics, epoch_started=0, blocked_since=0)
        committer.wait()
    committer.close()


def _run(config: TrainLoop, die_in_epoch: int, log: Path) -> int:
    # the loop configuration pickled as it is, as Ray ships it to a training worker
    process = multiprocessing.get_context("spawn").Process(
        target=_train, args=(config, die_in_epoch, str(log))
    )
    process.start()
    process.join(timeout=300)
    return process.exitcode or 0


def _epoch_log(log: Path, epoch: int) -> list[str]:
    return [
        line.split()[1] for line in log.read_text().splitlines() if line.split()[0] == str(epoch)
    ]


@pytest.mark.full  # a fault scenario of tens of seconds (tests/tiers.py)
def test_a_worker_killed_mid_epoch_resumes_on_the_same_rows_in_the_same_order(
    streamed: PreparedData, tmp_path: Path
) -> None:
    whole = _config(streamed, (tmp_path / "whole").as_uri(), epochs=4)
    assert _run(whole, 0, tmp_path / "whole.log") == 0
    killed = _config(streamed, (tmp_path / "killed").as_uri(), epochs=4)
    assert _run(killed, 3, tmp_path / "first.log") == 9, "killed in epoch 3"
    assert _run(killed, 0, tmp_path / "resumed.log") == 0
    assert not _epoch_log(tmp_path / "resumed.log", 2), "resumed from epoch 2's checkpoint"
    died = _epoch_log(tmp_path / "first.log", 3)
    resumed = _epoch_log(tmp_path / "resumed.log", 3)
    assert len(died) == 3 and resumed[:3] == died, "the restarted epoch begins where it did"
    assert resumed == _epoch_log(tmp_path / "whole.log", 3)
    models = [
        load_trained_model(
            c.checkpoint_url, "mlp", c.data.sample_shape, 3, c.model.factory_options()
        )
        for c in (whole, killed)
    ]
    assert models[0][1] == models[1][1] == 4
    for (name, a), b in zip(
        models[0][0].state_dict().items(), models[1][0].state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), f"{name} differs from the uninterrupted run's"


def test_a_streamed_table_holds_fixed_size_feature_lists(streamed: PreparedData) -> None:
    """The shard format Ray Data writes and workers read (``integrations.datasets``)."""
    first = datasets.read_manifest(streamed.splits_url)["train"][0]
    schema = pq.read_schema(Path(streamed.splits_url.removeprefix("file://")) / first.name)
    assert schema.field(datasets.FEATURES).type == pa.list_(pa.float32(), FEATURES)
    assert schema.field(datasets.LABEL).type == pa.int64()
