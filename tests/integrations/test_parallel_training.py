"""DDP and FSDP on gloo, mixed precision and gradient checkpointing, without Ray.

Worker groups are real ``torch.distributed`` process groups (spawned processes on loopback),
so these tests run the exact code Ray Train workers run, minus Ray's start-up.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from prefect_ml.integrations import datasets, training
from prefect_ml.integrations.config.loop import TrainLoop
from prefect_ml.integrations.datasets import ArrayShard, shard_bounds
from prefect_ml.integrations.errors import ConfigurationError
from prefect_ml.integrations.training import (
    EpochCommitter,
    EpochTrainer,
    MeshLayout,
)
from tests.fixtures.user_code import blobs
from tests.helpers import free_port, in_gloo_group

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _config(checkpoint_url: str, **overrides: Any) -> TrainLoop:
    values: dict[str, Any] = {
        "splits_url": "",
        "sample_shape": [6],
        "num_classes": 3,
        "model": "mlp",
        "model_options": {"hidden": 16, "depth": 2, "dropout": 0.0},
        "epochs": 3,
        "batch_size": 8,
        "lr": 0.01,
        "optimizer": "adam",
        "weight_decay": 0.0,
        "scheduler": "cosine",
        "seed": 3,
        "checkpoint_url": checkpoint_url,
        "tracking_uri": "",
        "run_id": "",
    }
    return TrainLoop.from_options(**{**values, **overrides})


def _shards(rank: int, world_size: int) -> dict[str, ArrayShard]:
    features, labels = blobs(rows=96, features=6)
    start, stop = shard_bounds(len(labels), rank, world_size)
    shard = ArrayShard(features[start:stop].astype(np.float32), labels[start:stop].astype(np.int64))
    return {"train": shard, "val": shard}


def _full_state(trainer: EpochTrainer, *, every_rank: bool = False) -> dict[str, torch.Tensor]:
    """The unsharded model state: on rank 0 (empty elsewhere), or on ``every_rank``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    distributed = torch.distributed.is_initialized()
    offload = distributed and not every_rank
    options = StateDictOptions(full_state_dict=distributed, cpu_offload=offload)
    state = get_model_state_dict(trainer.model, options=options)
    return {name: tensor.detach().clone() for name, tensor in state.items()}  # not live views


def _train_in_group(rank: int, world_size: int, config: TrainLoop, epochs: int, out: str) -> None:
    """Restore, train ``epochs`` more epochs, commit each."""
    from torch.nn.parallel import DistributedDataParallel

    # A tensor-parallel group or a pipeline reads one shard (integrations.training).
    trainer_layout = MeshLayout.of(config.training, world_size)
    trainer = EpochTrainer(
        config,
        rank=rank,
        world_size=world_size,
        prepare_model=DistributedDataParallel,
        shards=_shards(trainer_layout.data_rank(rank), trainer_layout.data_parallel),
    )
    restored = _full_state(trainer)
    committer = EpochCommitter(trainer.store) if trainer.writes_checkpoints else None
    history = []
    try:
        for epoch in range(trainer.first_epoch, trainer.first_epoch + epochs):
            metrics = trainer.train_epoch(epoch)
            files = trainer.snapshot(epoch)
            history.append(metrics)
            if committer is not None:
                committer.submit(epoch, files, metrics, epoch_started=0.0, blocked_since=0.0)
        final = _full_state(trainer)
        # Every rank's own state as well: a pipeline stage holds only its layers.
        torch.save(_full_state(trainer, every_rank=True), f"{out}.rank{rank}.pt")
    finally:  # its thread commits on the checkpoint group: done before the groups go
        if committer is not None:
            committer.close()
    if rank == 0:
        kind = type(trainer.model).__name__
        torch.save({"restored": restored, "final": final}, f"{out}.pt")
        report = {"first_epoch": trainer.first_epoch, "history": history, "wrapper": kind}
        Path(f"{out}.json").write_text(json.dumps(report))


def _run_group(
    world_size: int, config: TrainLoop, epochs: int, out: Path
) -> tuple[dict[str, Any], dict[str, Any]]:
    mp.start_processes(
        in_gloo_group,
        args=(world_size, free_port(), _train_in_group, config, epochs, str(out)),
        nprocs=world_size,
        start_method="spawn",
    )
    report = json.loads(out.with_suffix(".json").read_text())
    return report, torch.load(out.with_suffix(".pt"), weights_only=True)


def _assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=f"{name} differs")


def test_fsdp_trains_like_ddp_and_its_checkpoint_restores_under_other_layouts(
    tmp_path: Path,
) -> None:
    """FSDP2 on gloo computes what DDP computes; its DCP checkpoint restores into 3 DDP workers
    and into one unwrapped process, with the same weights, optimiser and schedule."""
    fsdp_url, ddp_url = (tmp_path / "fsdp").as_uri(), (tmp_path / "ddp").as_uri()
    fsdp, fsdp_state = _run_group(2, _config(fsdp_url, strategy="fsdp"), 2, tmp_path / "fsdp")
    ddp, ddp_state = _run_group(2, _config(ddp_url, strategy="ddp"), 2, tmp_path / "ddp")

    assert fsdp["wrapper"].startswith("FSDP") and ddp["wrapper"] == "DistributedDataParallel"
    for sharded, replicated in zip(fsdp["history"], ddp["history"], strict=True):
        assert sharded["train_loss"] == pytest.approx(replicated["train_loss"], rel=1e-5)
    _assert_same_weights(fsdp_state["final"], ddp_state["final"])

    # Two FSDP workers wrote epoch 2; three DDP workers resume it and train epoch 3.
    resumed, resumed_state = _run_group(3, _config(fsdp_url), 1, tmp_path / "resumed")
    assert resumed["first_epoch"] == 3
    _assert_same_weights(resumed_state["restored"], fsdp_state["final"])
    assert resumed["history"][0]["train_loss"] < fsdp["history"][0]["train_loss"]

    # One unwrapped process (a campaign trial, evaluation) reads the same checkpoint.
    single = EpochTrainer(_config(fsdp_url), shards=_shards(0, 1))
    assert single.first_epoch == 4
    _assert_same_weights(_full_state(single), resumed_state["final"])
    assert single.scheduler.last_epoch == 3, "the LR schedule resumed where it stopped"
    model, epoch = training.load_trained_model(
        fsdp_url, "mlp", [6], 3, _config("").model.factory_options()
    )
    assert epoch == 3
    _assert_same_weights(model.state_dict(), resumed_state["final"])


def _collectives_in_flight(rank: int, world_size: int) -> None:
    """What ends a DDP worker at its worst: the group kept alive by DDP, and collectives whose
    work gloo's threads still hold when the worker returns."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    DistributedDataParallel(torch.nn.Linear(2, 2))
    for _ in range(20):
        dist.all_reduce(torch.ones(1000), async_op=True)


def test_a_group_worker_ends_cleanly_with_gloo_work_in_flight() -> None:
    """Ended by the interpreter's shutdown, such a worker aborted almost every time (SIGABRT,
    "terminate called without an active exception"), as DDP workers did now and then."""
    mp.start_processes(
        in_gloo_group,
        args=(2, free_port(), _collectives_in_flight),
        nprocs=2,
        start_method="spawn",
    )


def test_checkpoints_are_distributed_checkpoint_directories(tmp_path: Path) -> None:
    trainer = EpochTrainer(_config(tmp_path.as_uri()), shards=_shards(0, 1))
    files = trainer.snapshot(1)
    assert ".metadata" in files and any(name.endswith(".distcp") for name in files)
    state = json.loads(files[training.TRAINER_STATE_FILE])
    assert state["epoch"] == 1 and state["scaler"] is None


def test_a_checkpoint_written_before_the_optimiser_state_was_flattened_still_resumes(
    tmp_path: Path,
) -> None:
    """Checkpoints now hold the optimiser state flattened per parameter (pipeline stages hold
    different parameters); one of the earlier nested form restores all the same."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from prefect_ml.integrations import training
    from prefect_ml.integrations.storage import CheckpointStore

    url = tmp_path.as_uri()
    trainer = EpochTrainer(_config(url), shards=_shards(0, 1))
    trainer.train_epoch(1)
    model_state, optimizer_state = get_state_dict(trainer.state_module, trainer.optimizer)
    files = training.to_files({"model": model_state, "optimizer": optimizer_state})
    trainer_state = {"epoch": 1, "seed": 3, "scheduler": trainer.scheduler.state_dict()}
    files[training.TRAINER_STATE_FILE] = json.dumps(trainer_state).encode()
    CheckpointStore(url).save(1, files)

    resumed = EpochTrainer(_config(url), shards=_shards(0, 1))

    assert resumed.first_epoch == 2
    _assert_same_weights(_full_state(resumed), _full_state(trainer))
    moments = [trainer.optimizer.state[p]["exp_avg"] for p in trainer.model.parameters()]
    restored = [resumed.optimizer.state[p]["exp_avg"] for p in resumed.model.parameters()]
    for before, after in zip(moments, restored, strict=True):
        torch.testing.assert_close(before, after)


def test_bf16_autocast_trains_on_cpu_and_reports_peak_memory(tmp_path: Path) -> None:
    trainer = EpochTrainer(_config(tmp_path.as_uri(), precision="bf16"), shards=_shards(0, 1))
    with training.precision_context("bf16", trainer.device):
        logits = trainer.model(torch.from_numpy(trainer.train.head(4)[0]))
    assert logits.dtype == torch.bfloat16
    first = trainer.train_epoch(1)
    last = trainer.train_epoch(2)
    assert last["train_loss"] < first["train_loss"]
    assert last["val_accuracy"] > 0.9
    assert first["peak_memory_mib"] > 10, "the worker's peak RSS, in MiB"


def test_fp16_is_refused_on_cpu_with_the_fix_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="training.precision.*--precision bf16"):
        # A GPU run's config on a worker without a GPU: the worker refuses it.
        config = _config(tmp_path.as_uri(), precision="fp16", use_gpu=True)
        EpochTrainer(config, shards=_shards(0, 1))


@pytest.mark.parametrize(
    ("model", "shape", "options"),
    [
        ("mlp", (6,), {"hidden": 32, "depth": 4, "dropout": 0.2}),
        ("cnn", (1, 8, 8), {"channels": 4, "dropout": 0.2}),
    ],
)
def test_gradient_checkpointing_gives_the_same_loss_and_gradients(
    model: str, shape: tuple[int, ...], options: dict[str, Any]
) -> None:
    torch.manual_seed(0)
    plain = datasets.build_model(model, shape, 3, options)
    checkpointed = datasets.enable_gradient_checkpointing(copy.deepcopy(plain))
    features, labels = torch.randn(16, *shape), torch.randint(0, 3, (16,))
    losses = []
    for network in (plain, checkpointed):
        torch.manual_seed(1)  # the same dropout masks; recomputation replays them
        loss = torch.nn.functional.cross_entropy(network.train()(features), labels)
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert plain.state_dict().keys() == checkpointed.state_dict().keys()


def test_gradient_checkpointing_calls_a_user_models_hook_and_refuses_a_model_without_one() -> None:
    from tests.fixtures.user_code import SlowLinear

    hooked = SlowLinear(4, 2, delay=0.0)
    datasets.enable_gradient_checkpointing(hooked)
    assert hooked.checkpointing
    plain = torch.nn.Linear(4, 2)
    with pytest.raises(ConfigurationError, match="training.gradient_checkpointing.*"):
        datasets.enable_gradient_checkpointing(plain)


@pytest.mark.gpu
@requires_cuda
def test_fp16_on_cuda_scales_the_loss_and_checkpoints_the_scale(tmp_path: Path) -> None:
    trainer = EpochTrainer(
        _config(tmp_path.as_uri(), precision="fp16"),
        device=torch.device("cuda"),
        shards=_shards(0, 1),
    )
    assert trainer.scaler.is_enabled()
    first, last = trainer.train_epoch(1), trainer.train_epoch(2)
    assert last["train_loss"] < first["train_loss"]
    files = trainer.snapshot(2)
    assert json.loads(files[training.TRAINER_STATE_FILE])["scaler"]["scale"] > 0


def _nccl_worker(rank: int, world_size: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from prefect_ml.integrations import compute

    backend = compute.collective_backend(use_gpu=True)
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    torch.cuda.set_device(rank % torch.cuda.device_count())
    value = torch.ones(1, device="cuda") * (rank + 1)
    dist.all_reduce(value)
    if rank == 0:
        Path(out).write_text(json.dumps({"backend": backend, "sum": value.item()}))
    dist.destroy_process_group()


@pytest.mark.gpu
@requires_cuda
def test_nccl_all_reduce_on_gpus(tmp_path: Path) -> None:
    out = tmp_path / "nccl.json"
    world_size = min(2, torch.cuda.device_count())  # NCCL refuses two ranks on one GPU
    os.environ.setdefault("NCCL_DEBUG", "WARN")
    mp.start_processes(
        _nccl_worker,
        args=(world_size, free_port(), str(out)),
        nprocs=world_size,
        start_method="spawn",
    )
    expected = world_size * (world_size + 1) / 2
    assert json.loads(out.read_text()) == {"backend": "nccl", "sum": expected}


def _host_syncs_in_an_epoch(checkpoint_url: str, precision: str, rows: int) -> int:
    """Synchronising CUDA calls the second epoch makes (the first allocates on first use)."""
    import warnings

    features, labels = blobs(rows=rows, features=6)
    shard = ArrayShard(features.astype(np.float32), labels.astype(np.int64))
    trainer = EpochTrainer(
        _config(checkpoint_url, precision=precision),
        device=torch.device("cuda"),
        shards={"train": shard, "val": shard},
    )
    trainer.train_epoch(1)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            trainer.train_epoch(2)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(warning.message) for warning in caught)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_cuda_epoch_waits_for_the_gpu_a_fixed_number_of_times_whatever_its_steps(
    tmp_path: Path, precision: str
) -> None:
    """No step waits for the GPU (a host index, a ``float(loss)``): the host queues the next step
    while the GPU runs this one. Only the epoch's metrics are read back, once."""
    few = _host_syncs_in_an_epoch((tmp_path / "few").as_uri(), precision, rows=32)  # 4 steps
    many = _host_syncs_in_an_epoch((tmp_path / "many").as_uri(), precision, rows=256)  # 32 steps
    assert few == many, (few, many)
