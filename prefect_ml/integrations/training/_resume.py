"""Resume: where a run continues from its newest verified checkpoint, and how it ended.

A checkpoint restores into the current layout whatever strategy and worker count wrote it
(:func:`restore`); one taken inside an epoch continues that epoch at the next step
(:class:`ResumePoint`, :func:`epoch_start`), with each rank's RNG state and running loss
when the worker count is the same. The driver reads how a run ended from its checkpoints
alone (:func:`training_end`), and evaluation loads the model of one (:func:`load_trained_model`).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prefect_ml.integrations import compute
from prefect_ml.integrations.datasets import build_model
from prefect_ml.integrations.early_stopping import EarlyStopping, StopDecision
from prefect_ml.integrations.errors import CheckpointError
from prefect_ml.integrations.storage import CheckpointStore, VerifiedCheckpoint
from prefect_ml.integrations.training import (
    _collectives,
    _distributed_checkpoint,
    _hooks,
    _optimization,
)
from prefect_ml.integrations.training._commit import METRICS_FILE, TRAINER_STATE_FILE

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class ResumePoint:
    """Where a mid-epoch checkpoint left its epoch: ``step`` steps trained by ``world_size``
    workers (``data_world_size`` model replicas reading their own shards), and each rank's
    torch RNG state and running train-loss sum (rank order)."""

    epoch: int
    step: int
    world_size: int
    data_world_size: int
    ranks: list[dict[str, Any]]


def restore(
    files: Mapping[str, bytes | bytearray],
    state_module: torch.nn.Module,
    optimizing: _optimization.Optimization,
    scaler: torch.amp.GradScaler,
    loop_state: _hooks.LoopState | None,
) -> tuple[int, ResumePoint | None]:
    """Load a checkpoint's model, optimiser, schedules and loss scale into this worker's;
    the epoch to train first, and where inside it to continue (a mid-epoch checkpoint's)."""
    try:
        load_state(files, state_module, optimizing.optimizer, flatten=True)
    except CheckpointError:  # written before optimiser state was flattened per parameter
        load_state(files, state_module, optimizing.optimizer, flatten=False)
    trainer_state = json.loads(files[TRAINER_STATE_FILE])
    # One scheduler's state under "scheduler" before configure_optimizers' forms came.
    schedulers = trainer_state.get("schedulers", [trainer_state.get("scheduler")])
    optimizing.load_state_dict([state for state in schedulers if state is not None])
    if loop_state is not None:
        loop_state.global_step = int(trainer_state.get("global_step", 0))
    if trainer_state.get("scaler"):
        scaler.load_state_dict(trainer_state["scaler"])
    epoch = int(trainer_state["epoch"])
    if trainer_state.get("step") is None:
        return epoch + 1, None
    resume = ResumePoint(  # a mid-epoch checkpoint: that epoch continues
        epoch,
        int(trainer_state["step"]),
        int(trainer_state["world_size"]),
        int(trainer_state.get("data_world_size", trainer_state["world_size"])),
        trainer_state["ranks"],
    )
    return epoch, resume


def load_state(
    files: Mapping[str, bytes | bytearray],
    state_module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    flatten: bool,
) -> None:
    """The model and optimiser state of a checkpoint's DCP files, into this layout."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )

    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    model_state, optimizer_state = get_state_dict(state_module, optimizer, options=options)
    _distributed_checkpoint.load_files(files, {"model": model_state, "optimizer": optimizer_state})
    set_state_dict(
        state_module,
        optimizer,
        model_state_dict=model_state,
        optim_state_dict=optimizer_state,
        options=options,
    )


def epoch_start(
    resume: ResumePoint | None,
    epoch: int,
    worker_seed: int,
    device: torch.device,
    *,
    rank: int,
    layout: tuple[int, int],
) -> tuple[int, torch.Tensor]:
    """The step ``epoch`` starts at and its running train-loss sum, with torch's RNG set
    to match: step 0, a zero sum and the epoch's ``worker_seed``, or where the mid-epoch
    checkpoint ``resume`` left them.

    With the worker count that wrote the checkpoint (``layout``: this group's world size and
    data-parallel size), each rank takes back its own RNG state and loss sum: the epoch goes
    on exactly as it would have. With another count the shards differ, so it starts at the
    step that covers the same share of the epoch's samples, with the epoch's seed and the
    loss summed so far on rank 0.
    """
    import torch

    loss_sum = torch.zeros((), device=device)
    if resume is None or resume.epoch != epoch:
        compute.seed_rngs(worker_seed, device)
        return 0, loss_sum
    if (resume.world_size, resume.data_world_size) != layout:
        compute.seed_rngs(worker_seed, device)
        if rank == 0:
            loss_sum += sum(float(part["loss_sum"]) for part in resume.ranks)
        return resume.step * resume.data_world_size // layout[1], loss_sum
    state = resume.ranks[rank]
    torch.set_rng_state(_tensor_of(state["rng"]))
    if state.get("cuda_rng") and device.type == "cuda":
        torch.cuda.set_rng_state(_tensor_of(state["cuda_rng"]), device)
    loss_sum += float(state["loss_sum"])
    return resume.step, loss_sum


def mid_epoch_state(
    step: int, loss_sum: torch.Tensor, device: torch.device, layout: tuple[int, int]
) -> dict[str, Any]:
    """What a checkpoint taken ``step`` steps into an epoch adds to the trainer state: the
    step, the group's ``layout`` (world size, data-parallel size) and every rank's RNG states
    and running loss sum, gathered to rank 0 (a collective: every worker calls it)."""
    import torch

    cuda = device.type == "cuda"
    own = {
        "rng": _text_of(torch.get_rng_state()),
        "cuda_rng": _text_of(torch.cuda.get_rng_state(device)) if cuda else None,
        "loss_sum": float(loss_sum),  # a float32 sum: exact as a Python float
    }
    gathered = _collectives.gather_strings(json.dumps(own))
    return {
        "step": step,
        "world_size": layout[0],
        "data_world_size": layout[1],
        "ranks": [json.loads(rank) for rank in gathered],
    }


def _text_of(state: torch.Tensor) -> str:
    """An RNG state (a uint8 tensor) as base64 text, for JSON."""
    return base64.b64encode(state.numpy().tobytes()).decode()


def _tensor_of(text: str) -> torch.Tensor:
    import torch

    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def committed_history(store: CheckpointStore, last_epoch: int) -> dict[int, dict[str, float]]:
    """Metrics of every verified epoch up to ``last_epoch``, pruned ones included (retention
    keeps every epoch's metrics file)."""
    history = {}
    for epoch in range(1, last_epoch + 1):
        try:
            history[epoch] = json.loads(store.read_verified(epoch, METRICS_FILE))
        except CheckpointError:
            continue  # a broken checkpoint: that epoch's values are missing, not shifted
    return history


@dataclass(frozen=True)
class TrainingEnd:
    """How a run's training ended, read from its verified checkpoints alone."""

    final: VerifiedCheckpoint
    best_epoch: int  # the checkpoint evaluated and registered
    stopped: StopDecision | None  # early stopping's decision, if it ended the run


def training_end(
    store: CheckpointStore,
    final: VerifiedCheckpoint | None,
    early_stopping: EarlyStopping | None,
    epochs: int,
) -> TrainingEnd | None:
    """How the run whose newest verified checkpoint is ``final`` ended; None while it has
    epochs left to train (early stopping decides from the committed epochs' metrics), as it
    has when ``final`` was taken inside an epoch."""
    if final is None or final.step is not None:
        return None
    history = committed_history(store, final.epoch) if early_stopping else {}
    stopped = early_stopping.decide(history) if early_stopping else None
    if final.epoch < epochs and (stopped is None or final.epoch < stopped.epoch):
        return None
    best = early_stopping.best(history) if early_stopping else None
    return TrainingEnd(final, best.epoch if best else final.epoch, stopped)


def load_trained_model(
    checkpoint_url: str,
    model_name: str,
    input_shape: list[int],
    num_classes: int,
    model_options: dict[str, Any],
    epoch: int | None = None,
) -> tuple[torch.nn.Module, int]:
    """The model of checkpoint ``epoch`` under ``checkpoint_url`` (by default the newest
    verified one), and its epoch."""
    store = CheckpointStore(checkpoint_url)
    latest = store.latest() if epoch is None else store.load(epoch)
    if latest is None:
        raise CheckpointError(f"no verified checkpoint under {checkpoint_url}")
    model = build_model(model_name, input_shape, num_classes, model_options)
    state = {"model": model.state_dict()}
    _distributed_checkpoint.load_files(latest.files, state)
    model.load_state_dict(state["model"])
    return model.eval(), latest.epoch
