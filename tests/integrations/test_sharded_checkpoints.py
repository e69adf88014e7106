"""Sharded checkpoints: every rank writes its own DCP shards, rank 0 commits one manifest.

Worker groups are real gloo process groups in spawned processes on loopback (the helpers of
``test_parallel_training``); storage is a local folder or moto's S3 server.
"""

from __future__ import annotations

import json
import os
import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from prefect_ml.integrations import storage, training
from prefect_ml.integrations.errors import CheckpointError
from prefect_ml.integrations.storage import MANIFEST, CheckpointStore, RetentionPolicy
from prefect_ml.integrations.training import EpochCommitter, EpochTrainer, resolve_layout
from tests.helpers import free_port
from tests.integrations.test_parallel_training import (
    _assert_same_weights,
    _config,
    _full_state,
    _run_group,
    _shards,
)


def _manifest(url: str, epoch: int) -> dict[str, Any]:
    manifest_url = storage.join(CheckpointStore(url).url_for(epoch), MANIFEST)
    return dict(json.loads(storage.read_bytes(manifest_url)))


def _shard_names(manifest: dict[str, Any]) -> set[str]:
    return {name for name in manifest["files"] if name.endswith(".distcp")}


@pytest.mark.parametrize(
    ("strategy", "layout"), [("ddp", "auto"), ("ddp", "gathered"), ("fsdp", "auto")]
)
def test_auto_shards_for_sharding_strategies_in_a_group_and_gathers_otherwise(
    strategy: str, layout: str
) -> None:
    expected = "sharded" if (strategy, layout) == ("fsdp", "auto") else "gathered"
    assert resolve_layout(layout, strategy, 2) == expected
    assert resolve_layout("sharded", strategy, 1) == "gathered", "one process has nothing to shard"
    assert resolve_layout("sharded", "ddp", 4) == "sharded"
    with pytest.raises(ValueError, match="checkpoint layout"):
        resolve_layout("scattered", strategy, 2)


@pytest.mark.parametrize(("world_size", "strategy"), [(2, "fsdp"), (4, "fsdp"), (2, "ddp")])
def test_every_rank_writes_its_shards_and_one_manifest_commits_them(
    tmp_path: Path, world_size: int, strategy: str
) -> None:
    """FSDP shards (and DDP's replicated tensors, deduplicated by DCP's planner) are written by
    every rank; the one verified manifest lists every rank's file and restores the weights."""
    url = (tmp_path / "run").as_uri()
    config = _config(url, strategy=strategy, checkpoint_layout="sharded")
    _, state = _run_group(world_size, config, 2, tmp_path / "out")

    store = CheckpointStore(url)
    assert store.epochs() == [1, 2]
    manifest = _manifest(url, 2)
    assert manifest["layout"] == "sharded" and manifest["writers"] == world_size
    shards = _shard_names(manifest)
    if strategy == "fsdp":  # each rank holds a shard of every parameter
        assert shards == {f"__{rank}_0.distcp" for rank in range(world_size)}
    else:  # one copy of each replicated tensor, spread over the ranks
        assert len(shards) >= 2 and shards <= {f"__{rank}_0.distcp" for rank in range(2)}
    assert {".metadata", "trainer.json", "metrics.json"} <= set(manifest["files"])
    checkpoint = store.latest()
    assert checkpoint is not None and checkpoint.epoch == 2
    options = config.model.factory_options()
    model, epoch = training.load_trained_model(url, "mlp", [6], 3, options)
    assert epoch == 2
    _assert_same_weights(model.state_dict(), state["final"])


def _dying_worker(rank: int, port: int, url: str, out: str) -> None:
    """Commits epoch 1 with its peer; for epoch 2 rank 1 uploads its shard and dies before the
    commit, and rank 0 records what its commit raised."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=15),  # the survivor gives up on its dead peer fast
    )
    trainer = EpochTrainer(
        _config(url, strategy="fsdp"), rank=rank, world_size=2, shards=_shards(rank, 2)
    )
    committer = EpochCommitter(trainer.store)
    metrics = trainer.train_epoch(1)
    committer.submit(1, trainer.snapshot(1), metrics, epoch_started=0.0, blocked_since=0.0)
    committer.wait()
    metrics = trainer.train_epoch(2)
    snapshot = trainer.snapshot(2)
    assert isinstance(snapshot, training.ShardedSnapshot)
    if rank == 1:
        files = training.shard_files(snapshot.state, snapshot.group)
        trainer.store.upload(2, files)
        os._exit(3)  # its shard is in storage; the commit never happens
    committer.submit(2, snapshot, metrics, epoch_started=0.0, blocked_since=0.0)
    try:
        committer.wait()
        outcome = "committed"
    except CheckpointError as exc:
        outcome = f"refused: {exc}"
    Path(out).write_text(outcome)
    os._exit(0)  # the group lost a member: tearing it down would wait for it


def test_a_rank_that_dies_before_the_commit_leaves_no_checkpoint(tmp_path: Path) -> None:
    url, out = (tmp_path / "run").as_uri(), tmp_path / "outcome.txt"
    context = mp.get_context("spawn")
    port = free_port()
    workers = [
        context.Process(target=_dying_worker, args=(rank, port, url, str(out))) for rank in (0, 1)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=90)
        if worker.is_alive():
            worker.kill()
    assert [worker.exitcode for worker in workers] == [0, 3]

    assert out.read_text().startswith("refused: could not commit a checkpoint")
    store = CheckpointStore(url)
    assert "__1_0.distcp" in os.listdir(tmp_path / "run" / "epoch-000002"), "rank 1 uploaded"
    assert not (tmp_path / "run" / "epoch-000002" / MANIFEST).exists()
    latest = store.latest()
    assert latest is not None and latest.epoch == 1
    resumed = EpochTrainer(_config(url), shards=_shards(0, 1))
    assert resumed.first_epoch == 2, "the next run resumes from the last committed checkpoint"


def test_a_sharded_fsdp_checkpoint_restores_into_ddp_on_three_workers_and_one_process(
    tmp_path: Path,
) -> None:
    url = (tmp_path / "run").as_uri()
    _, fsdp_state = _run_group(2, _config(url, strategy="fsdp"), 2, tmp_path / "fsdp")
    assert _manifest(url, 2)["layout"] == "sharded", "auto shards FSDP"

    resumed, ddp_state = _run_group(3, _config(url, strategy="ddp"), 0, tmp_path / "ddp")
    assert resumed["first_epoch"] == 3 and resumed["wrapper"] == "DistributedDataParallel"
    _assert_same_weights(ddp_state["restored"], fsdp_state["final"])

    single = EpochTrainer(_config(url), shards=_shards(0, 1))
    assert single.first_epoch == 3 and single.scheduler.last_epoch == 2
    _assert_same_weights(_full_state(single), fsdp_state["final"])
    moments = single.optimizer.state_dict()["state"]
    assert moments and all(float(state["step"]) == 2 * 6 for state in moments.values()), (
        "Adam's state restored (2 epochs of 6 steps)"
    )


def test_a_sharded_checkpoint_on_s3_verifies_and_loads(tmp_path: Path, s3_bucket: str) -> None:
    url = f"{s3_bucket}/runs/sharded"
    _, state = _run_group(2, _config(url, strategy="fsdp"), 1, tmp_path / "out")
    store = CheckpointStore(url)
    checkpoint = store.latest()
    assert checkpoint is not None and checkpoint.epoch == 1
    assert _shard_names(_manifest(url, 1)) == {"__0_0.distcp", "__1_0.distcp"}
    options = _config("").model.factory_options()
    model, _ = training.load_trained_model(url, "mlp", [6], 3, options)
    _assert_same_weights(model.state_dict(), state["final"])


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two epochs of a 2-rank FSDP run, checkpointed sharded."""
    root = tmp_path_factory.mktemp("sharded")
    _run_group(2, _config((root / "run").as_uri(), strategy="fsdp"), 2, root / "out")
    return root / "run"


def _copy(run: Path, tmp_path: Path) -> tuple[Path, CheckpointStore]:
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    return copy, CheckpointStore(copy.as_uri())


def test_a_tampered_shard_is_refused(sharded_run: Path, tmp_path: Path) -> None:
    run, store = _copy(sharded_run, tmp_path)
    shard = run / "epoch-000002" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"__1_0\.distcp does not match its sha256"):
        store.load(2)
    latest = store.latest()
    assert latest is not None and latest.epoch == 1, "the previous checkpoint is the resume point"


def test_a_missing_shard_is_refused(sharded_run: Path, tmp_path: Path) -> None:
    run, store = _copy(sharded_run, tmp_path)
    (run / "epoch-000002" / "__0_0.distcp").unlink()
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp is listed in the manifest"):
        store.load(2)


def test_the_commit_refuses_a_listing_whose_file_is_not_in_place(tmp_path: Path) -> None:
    """Phase two checks what phase one said it wrote; nothing is committed otherwise."""
    store = CheckpointStore(tmp_path.as_uri())
    mine = store.upload(1, {"__0_0.distcp": b"rank zero"})
    theirs = {"__1_0.distcp": {"sha256": "0" * 64, "size": 9}}  # a rank whose upload was lost
    with pytest.raises(CheckpointError, match=r"__1_0\.distcp is missing"):
        store.commit(1, [mine, theirs], {".metadata": b"meta"})
    short = store.upload(1, {"__1_0.distcp": b"rank"})
    with pytest.raises(CheckpointError, match="4 bytes, not the 9"):
        store.commit(1, [mine, {"__1_0.distcp": {**short["__1_0.distcp"], "size": 9}}], {})
    with pytest.raises(CheckpointError, match="also wrote"):
        store.commit(1, [mine, mine], {})
    assert store.latest() is None and not (tmp_path / "epoch-000001" / MANIFEST).exists()

    stale = store.upload(1, {"__2_0.distcp": b"a dead attempt's"})  # it had 3 writers
    url = store.commit(1, [mine, short], {".metadata": b"meta"})
    assert "__2_0.distcp" in stale and "__2_0.distcp" not in os.listdir(tmp_path / "epoch-000001")
    assert store.load(1).files == {
        "__0_0.distcp": b"rank zero",
        "__1_0.distcp": b"rank",
        ".metadata": b"meta",
    }
    assert url.endswith("epoch-000001")


def test_pruning_a_sharded_checkpoint_removes_every_ranks_shards(
    sharded_run: Path, tmp_path: Path
) -> None:
    run, store = _copy(sharded_run, tmp_path)
    assert store.prune(RetentionPolicy(keep_last=1)) == [1]
    assert sorted(os.listdir(run / "epoch-000001")) == [MANIFEST, "metrics.json"]
    pruned = json.loads((run / "epoch-000001" / MANIFEST).read_text())
    assert pruned["pruned"] and pruned["layout"] == "sharded"
    assert store.load(2).epoch == 2


def test_a_sharded_manifest_is_signed_as_a_gathered_one_is(tmp_path: Path) -> None:
    writer = CheckpointStore(tmp_path.as_uri(), key=b"the key")
    writer.commit(1, [writer.upload(1, {"__0_0.distcp": b"shard"})], {".metadata": b"meta"})
    reader = CheckpointStore(tmp_path.as_uri(), key=b"the key")
    assert reader.load(1).files["__0_0.distcp"] == b"shard"
    with pytest.raises(CheckpointError, match="HMAC signature"):
        CheckpointStore(tmp_path.as_uri(), key=b"another key").load(1)
