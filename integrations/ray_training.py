"""Ray Train v2: the per-worker training loop and the ``TorchTrainer`` that runs it.

The loop owns checkpointing through :class:`CheckpointStore` (atomic, verified) instead of Ray
Train's checkpoints, so that a restarted worker group, a restarted process and a reader on
another machine all resume from the same verified bytes. Rank 0 commits one checkpoint per
epoch, its metrics included; the driver logs those metrics to MLflow once each.
"""

from __future__ import annotations

import io
import json
import math
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from integrations import storage, tracking
from integrations.catalog import build_model
from integrations.checkpoints import CheckpointStore, RetentionPolicy
from integrations.errors import CheckpointError

if TYPE_CHECKING:
    import torch

STATE_FILE = "state.pt"
METRICS_FILE = "metrics.json"
# Epoch at which the latest worker group started: > 1 after a restart from a checkpoint.
STARTED_AT_TAG = "prefect_ml.worker_group_started_at_epoch"


@dataclass(frozen=True)
class TrainLoopConfig:
    """Everything a worker needs, as plain data (it crosses process boundaries)."""

    splits_url: str
    input_shape: list[int]
    num_classes: int
    model: str
    model_options: dict[str, Any]
    epochs: int
    batch_size: int
    lr: float
    optimizer: str
    weight_decay: float
    scheduler: str
    seed: int
    checkpoint_url: str
    tracking_uri: str
    run_id: str  # MLflow run told where the worker group started; "" for none
    stop_url: str = ""  # a file whose existence asks the workers to stop after this epoch
    keep_checkpoints: int = 0  # newest checkpoints that keep their weights; 0 keeps every one
    best_checkpoint_metric: str = "val_loss"  # also kept; "none" keeps no best

    def retention(self) -> RetentionPolicy | None:
        if self.keep_checkpoints < 1:
            return None
        metric = None if self.best_checkpoint_metric == "none" else self.best_checkpoint_metric
        return RetentionPolicy(
            keep_last=self.keep_checkpoints,
            metric=metric,
            mode="max" if metric == "val_accuracy" else "min",
            metrics_file=METRICS_FILE,
            kept_files=(METRICS_FILE,),
        )


def shard_bounds(rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of worker ``rank``; every worker gets the same count.

    Equal shards keep DDP's collective calls in step; the at most ``world_size - 1`` rows left
    over are dropped (the split was shuffled, so they are a random few).
    """
    per_worker = rows // world_size
    return rank * per_worker, (rank + 1) * per_worker


def load_shard(
    splits_url: str, split: str, rank: int, world_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """This worker's rows of one split, reading only those bytes."""
    labels_url = storage.join(splits_url, f"{split}_labels.npy")
    rows = storage.read_array(labels_url).shape[0]
    start, stop = shard_bounds(rows, rank, world_size)
    features = storage.read_array_rows(
        storage.join(splits_url, f"{split}_features.npy"), start, stop
    )
    labels = storage.read_array_rows(labels_url, start, stop)
    return features, labels


def make_optimizer(name: str, params: Any, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    import torch

    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)


def make_scheduler(name: str, optimizer: torch.optim.Optimizer, epochs: int) -> Any:
    import torch

    if name == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)


def serialize_state(state: dict[str, Any]) -> bytes:
    import torch

    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def deserialize_state(data: bytes) -> dict[str, Any]:
    """Load a state saved by :func:`serialize_state`; never unpickles arbitrary objects."""
    import torch

    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)  # type: ignore[no-any-return]


def _all_reduce_sum(values: list[float]) -> list[float]:
    import torch
    import torch.distributed as dist

    tensor = torch.tensor(values, dtype=torch.float64)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor)
    return tensor.tolist()  # type: ignore[no-any-return]


def epoch_seed(seed: int, epoch: int, rank: int) -> int:
    """The seed of one worker's epoch: shuffling and dropout are a pure function of it.

    Reseeding every epoch makes a resumed run draw exactly the numbers the uninterrupted run
    would have, without gathering per-worker RNG states into every checkpoint.
    """
    return int(np.random.SeedSequence([seed, epoch, rank]).generate_state(1)[0])


class EpochCommitter:
    """Rank 0's background writer: commits each epoch's checkpoint while training carries on.

    The loop hands over serialised bytes. One commit is in flight at a time, so commits stay in
    epoch order and memory stays bounded. After each commit the retention policy, if any, prunes
    the checkpoints it does not keep. Workers never write metrics anywhere else: the driver
    turns committed checkpoints into MLflow history (see ``tasks.train.EpochRecorder``), which
    keeps MLflow's client work off the training process's interpreter lock.
    """

    def __init__(self, store: CheckpointStore, retention: RetentionPolicy | None = None) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._store, self._retention = store, retention
        self.committed_epoch = 0  # the newest epoch this committer committed
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self._in_flight: Future[str] | None = None

    def submit(
        self,
        epoch: int,
        state: bytes,
        metrics: dict[str, float],
        *,
        epoch_started: float,
        blocked_since: float,
    ) -> None:
        """Queue one epoch; the loop was blocked from ``blocked_since`` until this returns."""
        self.wait()
        now = time.perf_counter()
        metrics = {
            **metrics,
            # What checkpointing cost the loop: the snapshot plus waiting for the previous commit.
            "checkpoint_blocking_seconds": now - blocked_since,
            "epoch_seconds": now - epoch_started,  # wall time of the whole epoch on rank 0
        }
        files = {STATE_FILE: state, METRICS_FILE: json.dumps(metrics).encode()}
        self._in_flight = self._executor.submit(self._commit, epoch, files)

    def _commit(self, epoch: int, files: dict[str, bytes]) -> str:
        url = self._store.save(epoch, files)
        self.committed_epoch = epoch
        if self._retention is not None:
            self._store.prune(self._retention)
        return url

    def wait(self) -> None:
        """Block until the queued commit is done; raise a :class:`CheckpointError` if it failed
        (storage unreachable past its retries): the run then resumes from the last commit."""
        if self._in_flight is None:
            return
        in_flight, self._in_flight = self._in_flight, None
        try:
            in_flight.result()
        except Exception as exc:
            last = f"epoch {self.committed_epoch}" if self.committed_epoch else "none yet"
            raise CheckpointError(
                f"could not commit a checkpoint to {self._store.root_url} "
                f"({type(exc).__name__}: {exc}); the last one committed here is {last}. "
                "Run again to resume from the last verified checkpoint."
            ) from exc

    def close(self) -> None:
        self.wait()
        self._executor.shutdown()


def evaluate_batches(
    model: torch.nn.Module, features: torch.Tensor, labels: torch.Tensor, batch_size: int
) -> tuple[float, int, int]:
    """(summed loss, correct predictions, rows) of ``model`` on the given rows."""
    import torch
    import torch.nn.functional as F

    loss_sum, correct = 0.0, 0
    model.eval()
    with torch.no_grad():
        for start in range(0, len(labels), batch_size):
            logits = model(features[start : start + batch_size])
            target = labels[start : start + batch_size]
            loss_sum += float(F.cross_entropy(logits, target, reduction="sum"))
            correct += int((logits.argmax(dim=1) == target).sum())
    return loss_sum, correct, len(labels)


class EpochTrainer:
    """One worker's model, optimiser and data shard, trained one epoch at a time.

    Shared by Ray Train workers (``train_loop_per_worker``, DDP) and campaign trials that train
    in one warm process. It resumes from the newest verified checkpoint in ``checkpoint_url``.
    """

    def __init__(
        self,
        config: TrainLoopConfig,
        *,
        rank: int = 0,
        world_size: int = 1,
        device: torch.device | None = None,
        prepare_model: Any = None,
        shards: dict[str, tuple[np.ndarray, np.ndarray]] | None = None,
    ) -> None:
        import torch

        self.config, self.rank, self.world_size = config, rank, world_size
        self.device = device or torch.device("cpu")
        torch.manual_seed(epoch_seed(config.seed, 0, 0))  # the same initial weights everywhere
        model = build_model(
            config.model, config.input_shape, config.num_classes, config.model_options
        )
        self.optimizer = make_optimizer(
            config.optimizer, model.parameters(), config.lr, config.weight_decay
        )
        self.scheduler = make_scheduler(config.scheduler, self.optimizer, config.epochs)
        self.store = CheckpointStore(config.checkpoint_url)
        self.first_epoch = 1
        latest = self.store.latest()
        if latest is not None:
            state = deserialize_state(latest.files[STATE_FILE])
            model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            self.first_epoch = int(state["epoch"]) + 1
        self.model = prepare_model(model) if prepare_model else model
        shards = shards or {
            split: load_shard(config.splits_url, split, rank, world_size)
            for split in ("train", "val")
        }
        self.train_features, self.train_labels = (
            torch.from_numpy(a).to(self.device) for a in shards["train"]
        )
        self.val_features, self.val_labels = (
            torch.from_numpy(a).to(self.device) for a in shards["val"]
        )

    def train_epoch(self, epoch: int) -> dict[str, float]:
        """Train one epoch, then evaluate; metrics are summed over all workers."""
        import torch
        import torch.nn.functional as F

        config, model = self.config, self.model
        started = time.perf_counter()
        model.train()
        seed = epoch_seed(config.seed, epoch, self.rank)
        torch.manual_seed(seed)
        order = torch.from_numpy(np.random.default_rng(seed).permutation(len(self.train_labels)))
        loss_sum = torch.zeros((), device=self.device)  # summed on device: no host sync per step
        for step in range(math.ceil(len(self.train_labels) / config.batch_size)):
            index = order[step * config.batch_size : (step + 1) * config.batch_size]
            self.optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(self.train_features[index]), self.train_labels[index])
            loss.backward()
            self.optimizer.step()
            loss_sum += loss.detach() * len(index)
        self.scheduler.step()
        train_seconds = time.perf_counter() - started
        val_loss, val_correct, val_rows = evaluate_batches(
            model, self.val_features, self.val_labels, max(config.batch_size, 256)
        )
        totals = _all_reduce_sum(
            [
                float(loss_sum),
                len(self.train_labels),
                val_loss,
                val_correct,
                val_rows,
                train_seconds,
            ]
        )
        return {
            "train_loss": totals[0] / totals[1],
            "val_loss": totals[2] / totals[4],
            "val_accuracy": totals[3] / totals[4],
            "samples_per_second": totals[1] / (totals[5] / self.world_size),
        }

    def snapshot(self, epoch: int) -> bytes:
        """The training state after ``epoch``, serialised (what a checkpoint stores)."""
        module: torch.nn.Module = getattr(self.model, "module", self.model)  # unwrap DDP
        return serialize_state(
            {
                "model": module.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "epoch": epoch,
                "seed": self.config.seed,
            }
        )

    def committed_metrics(self) -> dict[int, dict[str, float]]:
        """Metrics of every verified epoch before ``first_epoch`` (a resumed trial's history)."""
        history = {}
        for epoch in range(1, self.first_epoch):
            try:
                history[epoch] = json.loads(self.store.read_verified(epoch, METRICS_FILE))
            except CheckpointError:
                continue  # a broken checkpoint: that epoch's values are missing, not shifted
        return history


def stop_requested(stop_url: str) -> bool:
    """Whether someone asked this run to stop (a pruned trial); every worker agrees."""
    flag = 1.0 if stop_url and storage.exists(stop_url) else 0.0
    return _all_reduce_sum([flag])[0] > 0


def train_loop_per_worker(config_dict: dict[str, Any]) -> None:
    """One Ray Train worker: resume from the newest verified checkpoint, then train epochs."""
    import ray.train
    import ray.train.torch

    config = TrainLoopConfig(**config_dict)
    context = ray.train.get_context()
    trainer = EpochTrainer(
        config,
        rank=context.get_world_rank(),
        world_size=context.get_world_size(),
        device=ray.train.torch.get_device(),
        prepare_model=ray.train.torch.prepare_model,
    )
    if trainer.rank == 0 and config.run_id:
        tracking.set_tags(
            tracking.client_for(config.tracking_uri),
            config.run_id,
            {STARTED_AT_TAG: str(trainer.first_epoch)},
        )
    committer = EpochCommitter(trainer.store, config.retention()) if trainer.rank == 0 else None
    for epoch in range(trainer.first_epoch, config.epochs + 1):
        if stop_requested(config.stop_url):
            break
        started = time.perf_counter()
        metrics = trainer.train_epoch(epoch)
        if committer is not None:
            blocked_since = time.perf_counter()
            # Serialising is the snapshot; hashing and writing happen in the background.
            committer.submit(
                epoch,
                trainer.snapshot(epoch),
                metrics,
                epoch_started=started,
                blocked_since=blocked_since,
            )
    if committer is not None:
        committer.close()
    # Per-epoch metrics travel in the checkpoints. Ray Train v2's report() blocks until its
    # controller polls (every 2 s), which would dominate short epochs: Ray gets one final report.
    ray.train.report({"epoch": config.epochs})


def fit(
    config: TrainLoopConfig,
    *,
    workers: int,
    use_gpu: bool,
    cpus_per_worker: float,
    max_failures: int,
    ray_storage_url: str,
    name: str,
) -> None:
    """Run ``train_loop_per_worker`` on ``workers`` Ray Train workers (DDP; gloo or NCCL)."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    storage_path, storage_filesystem = storage.ray_storage(ray_storage_url)
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=asdict(config),
        scaling_config=ScalingConfig(
            num_workers=workers, use_gpu=use_gpu, resources_per_worker={"CPU": cpus_per_worker}
        ),
        run_config=RunConfig(
            name=name,
            storage_path=storage_path,
            storage_filesystem=storage_filesystem,
            failure_config=FailureConfig(max_failures=max_failures),
        ),
    )
    trainer.fit()


def load_trained_model(
    checkpoint_url: str,
    model_name: str,
    input_shape: list[int],
    num_classes: int,
    model_options: dict[str, Any],
) -> tuple[torch.nn.Module, int]:
    """The model of the newest verified checkpoint under ``checkpoint_url``, and its epoch."""
    latest = CheckpointStore(checkpoint_url).latest()
    if latest is None:
        raise CheckpointError(f"no verified checkpoint under {checkpoint_url}")
    model = build_model(model_name, input_shape, num_classes, model_options)
    model.load_state_dict(deserialize_state(latest.files[STATE_FILE])["model"])
    return model.eval(), latest.epoch
