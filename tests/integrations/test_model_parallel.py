"""Tensor and pipeline parallelism (``integrations.training``) on gloo, without Ray.

With one model replica (dp = 1) every rank reads the whole split in the order one process
reads it, so a tensor-parallel group or a pipeline must compute what one process computes;
with two replicas (dp = 2) what DDP on two workers computes. Worker groups are real
``torch.distributed`` process groups, spawned on loopback by the helpers of
``test_parallel_training``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from prefect_ml.integrations import training
from prefect_ml.integrations.config.loop import TrainLoop
from prefect_ml.integrations.errors import ConfigurationError
from prefect_ml.integrations.training import EpochTrainer, MeshLayout
from tests.integrations.test_parallel_training import (
    _assert_same_weights,
    _config,
    _full_state,
    _run_group,
    _shards,
)


def _one_process(config: TrainLoop, epochs: int) -> tuple[list[dict[str, float]], Any]:
    torch.set_num_threads(1)
    trainer = EpochTrainer(config, shards=_shards(0, 1))
    history = [trainer.train_epoch(epoch) for epoch in range(1, epochs + 1)]
    return history, _full_state(trainer)


def _merged_states(out: Path, world_size: int) -> dict[str, torch.Tensor]:
    """The union of every rank's final state (a pipeline stage holds only its layers)."""
    merged: dict[str, torch.Tensor] = {}
    for rank in range(world_size):
        merged.update(torch.load(f"{out}.rank{rank}.pt", weights_only=True))
    return merged


def _assert_same_losses(a: list[dict[str, float]], b: list[dict[str, float]]) -> None:
    assert len(a) == len(b)
    for first, second in zip(a, b, strict=True):
        for name in ("train_loss", "val_loss", "val_accuracy"):
            assert first[name] == pytest.approx(second[name], rel=1e-4, abs=1e-6), name


def test_tensor_parallel_trains_like_one_process(tmp_path: Path) -> None:
    """Two tensor-parallel ranks (one replica) read the data as one process does: the same
    per-epoch losses and final weights, per-rank memory and step time, and the DTensor
    collectives of a step counted."""
    config = _config((tmp_path / "tp").as_uri(), strategy="tp", epochs=2)
    report, state = _run_group(2, config, 2, tmp_path / "tp")
    single, single_state = _one_process(_config((tmp_path / "one").as_uri(), epochs=2), 2)

    _assert_same_losses(report["history"], single)
    _assert_same_weights(state["final"], single_state)
    last = report["history"][-1]
    assert last["samples_per_second"] > 0
    assert {"peak_memory_mib_rank0", "peak_memory_mib_rank1"} <= set(last)
    assert last["step_seconds_rank1"] > 0
    # a Colwise/Rowwise pair all-reduces in forward and the gathered head all-gathers
    assert last["collectives_per_step"] >= 2


def test_pipeline_parallel_trains_like_one_process(tmp_path: Path) -> None:
    """Two stages, 1F1B over 4 microbatches, a last batch smaller than the others: the same
    losses and weights as one process, validation through the pipeline, and the activation
    bytes a step sends reported."""
    options = {"strategy": "pp", "pipeline_microbatches": 4, "batch_size": 20, "epochs": 2}
    config = _config((tmp_path / "pp").as_uri(), **options)
    report, _ = _run_group(2, config, 2, tmp_path / "pp")
    single, single_state = _one_process(
        _config((tmp_path / "one").as_uri(), batch_size=20, epochs=2), 2
    )

    _assert_same_losses(report["history"], single)
    _assert_same_weights(_merged_states(tmp_path / "pp", 2), single_state)
    stage0 = torch.load(f"{tmp_path / 'pp'}.rank0.pt", weights_only=True)
    assert set(stage0) == {"1.weight", "1.bias"}, "stage 0 keeps its layers' full-model names"
    # 4 microbatches of 5 rows x 16 hidden float32 forward, the same back: 2 * 4 * 5 * 16 * 4
    assert report["history"][0]["p2p_bytes_per_step"] == 2 * 4 * 5 * 16 * 4


def test_a_two_dimensional_mesh_trains_like_ddp_on_its_replicas(tmp_path: Path) -> None:
    """dp = 2 x tp = 2 on 4 ranks (FSDP2 over dp after TP) computes what DDP on 2 ranks
    computes: each tensor-parallel pair reads one DDP worker's shard."""
    config = _config((tmp_path / "2d").as_uri(), strategy="tp", tensor_parallel_size=2, epochs=2)
    mesh, mesh_state = _run_group(4, config, 2, tmp_path / "2d")
    ddp, ddp_state = _run_group(
        2, _config((tmp_path / "ddp").as_uri(), epochs=2), 2, tmp_path / "ddp"
    )

    assert mesh["wrapper"].startswith("FSDP"), "the tensor-parallel model is FSDP-sharded over dp"
    _assert_same_losses(mesh["history"], ddp["history"])
    _assert_same_weights(mesh_state["final"], ddp_state["final"])
    assert mesh["history"][0]["workers"] == 4 and "peak_memory_mib_rank3" in mesh["history"][0]


def test_a_tensor_parallel_checkpoint_restores_into_ddp_and_one_process(tmp_path: Path) -> None:
    """A TP checkpoint (gathered: plain names, full tensors) resumes under DDP on 2 workers and
    in one unwrapped process with the same weights."""
    url = (tmp_path / "tp").as_uri()
    config = _config(url, strategy="tp", checkpoint_layout="gathered", epochs=3)
    _, tp_state = _run_group(2, config, 1, tmp_path / "tp")

    resumed, resumed_state = _run_group(2, _config(url, epochs=3), 1, tmp_path / "ddp")
    assert resumed["first_epoch"] == 2 and resumed["wrapper"] == "DistributedDataParallel"
    _assert_same_weights(resumed_state["restored"], tp_state["final"])

    single = EpochTrainer(_config(url, epochs=3), shards=_shards(0, 1))
    assert single.first_epoch == 3
    _assert_same_weights(_full_state(single), resumed_state["final"])


def test_the_mesh_puts_the_ranks_of_one_replica_next_to_each_other() -> None:
    layout = MeshLayout.of(_config("", strategy="pp", pipeline_parallel_size=2).training, 4)
    assert (layout.data_parallel, layout.model_parallel) == (2, 2)
    assert [layout.data_rank(rank) for rank in range(4)] == [0, 0, 1, 1]
    assert [layout.reports(rank) for rank in range(4)] == [False, True, False, True]
    tp = MeshLayout.of(_config("", strategy="tp").training, 2)
    assert (tp.data_parallel, [tp.reports(rank) for rank in range(2)]) == (1, [True, False])
    with pytest.raises(ConfigurationError, match="training.tensor_parallel_size.*divides"):
        MeshLayout.of(_config("", strategy="tp", workers=3, tensor_parallel_size=3).training, 4)


def test_the_built_in_plan_pairs_linears_across_elementwise_layers() -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    model = nn.Sequential(
        nn.Linear(4, 8),
        nn.ReLU(),
        nn.Dropout(),
        nn.Linear(8, 8),  # a pair
        nn.Linear(8, 8),
        nn.LayerNorm(8),
        nn.Linear(8, 8),  # LayerNorm breaks this one
        nn.Linear(8, 3),  # ... which pairs the next two
    )
    plan = training.sequential_plan(model, 2)
    kinds = {name: type(style).__name__ for name, style in plan.items()}
    assert kinds == {
        "0": "ColwiseParallel",
        "3": "RowwiseParallel",
        "4": "ColwiseParallel",
        "6": "ColwiseParallel",
        "7": "RowwiseParallel",
    }
    assert isinstance(plan["0"], ColwiseParallel) and isinstance(plan["3"], RowwiseParallel)
    replicated = plan["4"].output_layouts  # type: ignore[attr-defined]
    assert replicated[0].is_replicate(), "an unpaired Linear gathers its outputs"


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (
            lambda: nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU()),
            "training.strategy.*tensor_parallel_plan",
        ),
        (
            lambda: nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 2)),
            "model.model_options.*5 outputs",
        ),
        (
            lambda: nn.Bilinear(2, 2, 2),
            "training.strategy.*not an nn.Sequential.*tensor_parallel_plan",
        ),
    ],
)
def test_a_model_the_built_in_plan_cannot_split_is_refused_with_the_fix(
    build: Any, match: str
) -> None:
    model = build()
    with pytest.raises(ConfigurationError, match=match):
        if isinstance(model, nn.Sequential):
            training.sequential_plan(model, 2)
        else:
            training.tensor_parallel_plan(model, None)  # type: ignore[arg-type]


def test_the_driver_refuses_a_model_it_cannot_split_before_any_worker_starts() -> None:
    with torch.device("meta"):  # as tasks.train checks the model: no weights allocated
        convolutions = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten())
        shallow = nn.Sequential(nn.Linear(4, 2))
    with pytest.raises(ConfigurationError, match="training.strategy.*tensor_parallel_plan"):
        training.check_split(convolutions, "tp", 2)
    with pytest.raises(ConfigurationError, match="training.pipeline_parallel_size"):
        training.check_split(shallow, "pp", 2)
    training.check_split(shallow, "tp", 2)  # an unpaired Linear still splits
    training.check_split(convolutions, "ddp", 2)


def test_pipeline_stages_balance_parameters_and_keep_the_full_models_names() -> None:
    assert training.balanced_stages([10, 1, 1, 10], 2) == [0, 2]
    assert training.balanced_stages([1, 1, 1, 1], 4) == [0, 1, 2, 3]
    from prefect_ml.integrations.datasets import build_mlp

    full = build_mlp([6], 3, hidden=16, depth=2, dropout=0.0)
    names = set(full.state_dict())
    stages = [
        set(training.stage_module(build_mlp([6], 3, hidden=16, depth=2), k, 2).state_dict())
        for k in range(2)
    ]
    assert stages[0] | stages[1] == names and not stages[0] & stages[1]
    with pytest.raises(ConfigurationError, match="training.pipeline_parallel_size.*lower"):
        training.stage_module(build_mlp([6], 3, depth=1), 0, 3)
    with pytest.raises(ConfigurationError, match="not an nn.Sequential.*pipeline_stage"):
        training.stage_module(nn.Bilinear(2, 2, 2), 0, 2)


class _RenamingStages(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(2, 2)

    def pipeline_stage(self, stage: int, stages: int) -> nn.Module:
        return nn.Sequential(nn.Linear(2, 2))  # names the full model does not have


def test_a_user_stage_must_keep_the_full_models_names() -> None:
    with pytest.raises(ConfigurationError, match="model.pipeline_stage.*nn.Identity"):
        training.stage_module(_RenamingStages(), 0, 2)


def test_tp_and_pp_refuse_a_model_with_its_own_step_and_fp16() -> None:
    from tests.fixtures.user_code import steps_model

    model = steps_model([6], 3)
    for strategy in ("tp", "pp"):
        with pytest.raises(ConfigurationError, match="training.strategy.*--strategy ddp"):
            training.check_contract(model, strategy=strategy)
    with pytest.raises(ConfigurationError, match="training.precision.*bf16"):
        training.check_precision(
            _config("", strategy="pp", precision="fp16", use_gpu=True).training
        )


def test_pipelines_train_data_parallel_like_ddp_on_their_replicas(tmp_path: Path) -> None:
    """dp = 2 x pp = 2 on 4 ranks (each stage FSDP2-sharded over dp, GPipe): what DDP on 2
    ranks computes, each pipeline reading one DDP worker's shard."""
    options = {"strategy": "pp", "pipeline_parallel_size": 2, "pipeline_schedule": "gpipe"}
    config = _config((tmp_path / "2d").as_uri(), epochs=2, **options)
    mesh, _ = _run_group(4, config, 2, tmp_path / "2d")
    ddp, ddp_state = _run_group(
        2, _config((tmp_path / "ddp").as_uri(), epochs=2), 2, tmp_path / "ddp"
    )

    _assert_same_losses(mesh["history"], ddp["history"])
    _assert_same_weights(_merged_states(tmp_path / "2d", 2), ddp_state["final"])


def test_a_pipeline_checkpoint_restores_into_ddp_and_one_process(tmp_path: Path) -> None:
    """Each stage writes its own layers and optimiser state (sharded, under the full model's
    names); DDP on 2 workers and one process restore the whole model from them, and one
    process goes on exactly as if it had trained the first epoch itself (Adam's moments
    included)."""
    url = (tmp_path / "pp").as_uri()
    _run_group(2, _config(url, strategy="pp", epochs=2), 1, tmp_path / "pp")
    pp_final = _merged_states(tmp_path / "pp", 2)

    resumed, resumed_state = _run_group(2, _config(url, epochs=2), 0, tmp_path / "ddp")
    assert resumed["first_epoch"] == 2
    _assert_same_weights(resumed_state["restored"], pp_final)

    torch.set_num_threads(1)
    single = EpochTrainer(_config(url, epochs=2), shards=_shards(0, 1))
    assert single.first_epoch == 2
    _assert_same_weights(_full_state(single), pp_final)
    second_epoch = single.train_epoch(2)
    uninterrupted, _ = _one_process(_config((tmp_path / "one").as_uri(), epochs=2), 2)
    _assert_same_losses([second_epoch], uninterrupted[1:])


def test_a_pipeline_resumes_from_its_stages_checkpoint(tmp_path: Path) -> None:
    url = (tmp_path / "pp").as_uri()
    _run_group(2, _config(url, strategy="pp", epochs=2), 1, tmp_path / "first")
    again, _ = _run_group(2, _config(url, strategy="pp", epochs=2), 1, tmp_path / "again")
    uninterrupted, _ = _one_process(_config((tmp_path / "one").as_uri(), epochs=2), 2)
    assert again["first_epoch"] == 2
    _assert_same_losses(again["history"], uninterrupted[1:])


def _nccl_worker(rank: int, world_size: int, port: int, config: TrainLoop, out: str) -> None:
    import json

    import torch.distributed as dist

    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        layout = MeshLayout.of(config.training, world_size)
        trainer = EpochTrainer(
            config,
            rank=rank,
            world_size=world_size,
            device=device,
            shards=_shards(layout.data_rank(rank), layout.data_parallel),
        )
        history = [trainer.train_epoch(epoch) for epoch in (1, 2)]
        if rank == 0:
            Path(out).write_text(json.dumps(history))
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a GPU per rank")
@pytest.mark.parametrize("strategy", ["tp", "pp"])
def test_tensor_and_pipeline_parallel_on_nccl_train_like_one_process(
    tmp_path: Path, strategy: str
) -> None:
    import json

    import torch.multiprocessing as mp

    from tests.helpers import free_port

    config = _config((tmp_path / strategy).as_uri(), strategy=strategy, epochs=2)
    out = tmp_path / "history.json"
    mp.start_processes(
        _nccl_worker, args=(2, free_port(), config, str(out)), nprocs=2, start_method="spawn"
    )
    single, _ = _one_process(_config((tmp_path / "one").as_uri(), epochs=2), 2)
    _assert_same_losses(json.loads(out.read_text()), single)
