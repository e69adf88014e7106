"""One worker's training, a epoch at a time: the loop config, the data shard, the strategy
(DDP, FSDP2), precision, the task's loss and metrics or the model's own hooks, and the
checkpoint each epoch commits (and, with a step or time cadence, the ones it commits inside an
epoch, from which a resumed run continues at the next step); :func:`train_epochs` is a worker
group's loop, with the checkpoint budget that bounds what commits cost it. Only torch and
numpy: Ray Train workers (:mod:`integrations.ray_training`), campaign trials in one warm
process and the GPU check run it.

The loop owns checkpointing through :class:`CheckpointStore` (atomic, verified) instead of Ray
Train's checkpoints, so that a restarted worker group, a restarted process and a reader on
another machine all resume from the same verified bytes. Rank 0 commits one checkpoint per
epoch, its metrics included; the driver logs those metrics to MLflow once each. Under the
checkpoint budget (``checkpoint_budget``, a share of training time) an epoch whose weights do not
fit commits its metrics only: a resumed run then replays it from the last epoch with weights.

Checkpoints are ``torch.distributed.checkpoint`` (DCP) directories holding the model and
optimiser state under their plain parameter names (``get_state_dict`` strips the DDP and FSDP
wrappers), in one of two layouts (``training.checkpoint_layout``, resolved by
``distributed_checkpoint.resolve_layout``): *gathered* (DDP, one process), where rank 0
gathers the full state and commits it, or *sharded* (FSDP, TP, PP by default), where every
rank writes its own shards and rank 0 commits the manifest that names them all, so no host
ever holds the whole model. Loading goes through DCP into the current layout, so a checkpoint
written by 2 FSDP workers restores into 3 DDP workers, into one campaign trial, or into a
plain model for evaluation.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import math
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from prefect_ml.integrations import (
    collectives,
    distributed_checkpoint,
    hooks,
    model_parallel,
    optimization,
    problems,
    step_log,
    storage,
)
from prefect_ml.integrations.catalog import build_model, enable_gradient_checkpointing
from prefect_ml.integrations.checkpoints import CheckpointStore, RetentionPolicy
from prefect_ml.integrations.config import TrainingParams
from prefect_ml.integrations.config.loop import TrainLoop
from prefect_ml.integrations.distributed_checkpoint import ShardedSnapshot
from prefect_ml.integrations.early_stopping import EarlyStopping, History
from prefect_ml.integrations.errors import CheckpointError, ConfigurationError, ModelStepError
from prefect_ml.integrations.optimization import make_optimizer
from prefect_ml.integrations.shards import EpochOrder, Shard, epoch_seed, open_shard

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

TRAINER_STATE_FILE = "trainer.json"  # epoch, seed, LR schedule and loss scale, as JSON
# (a mid-epoch checkpoint adds its step and every rank's RNG state and running train loss)
METRICS_FILE = "metrics.json"
PRECISIONS = {"fp32": None, "bf16": "bfloat16", "fp16": "float16"}


def best_tracker(training: TrainingParams) -> EarlyStopping | None:
    """What picks the epoch whose weights the run must keep besides the last: early
    stopping's best (evaluated and registered), else the best-checkpoint metric's (one
    patient enough never to stop the run); None when neither is on."""
    if stopping := training.early_stopping():
        return stopping
    if training.best_checkpoint_metric == "none":
        return None
    return EarlyStopping.for_metric(
        training.best_checkpoint_metric, max(1, training.epochs), mode=training.best_checkpoint_mode
    )


def retention(training: TrainingParams) -> RetentionPolicy:
    """Which checkpoints keep their weights: the newest ``keep_checkpoints``, and the best by
    the best-checkpoint metric."""
    metric = None if training.best_checkpoint_metric == "none" else training.best_checkpoint_metric
    mode = training.best_checkpoint_mode
    if mode == "auto":
        mode = "max" if problems.EPOCH_METRICS.get(metric or "") == "maximize" else "min"
    return RetentionPolicy(
        keep_last=training.keep_checkpoints,
        metric=metric,
        mode=mode,
        metrics_file=METRICS_FILE,
        kept_files=(METRICS_FILE,),
    )


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


@dataclass(frozen=True)
class StagedSnapshot:
    """A gathered snapshot as a CPU copy of the state, serialised (``files``) only when it is
    committed: in the committer's thread, or never (a best epoch that a better one replaced)."""

    state: dict[str, Any]
    small: dict[str, bytes]  # the trainer state, as written

    def files(self) -> dict[str, bytes]:
        return {**distributed_checkpoint.to_files(self.state), **self.small}


Snapshot = dict[str, bytes] | StagedSnapshot | ShardedSnapshot


@dataclass
class CheckpointBudget:
    """Whether the next epoch's weights fit in ``fraction`` of the training time (rank 0's).

    ``spend`` adds what checkpoints blocked the loop (snapshots, waits for the committer,
    mid-epoch checkpoints); an epoch commits its weights when what was spent plus the cost of
    the last such commit stays within ``fraction`` of the time since ``started``. So the share
    tends to ``fraction`` from below whatever an epoch lasts: every epoch when commits are
    cheap, every k-th when an epoch is shorter than a commit over ``fraction``.
    """

    fraction: float
    started: float  # time.perf_counter() when the worker group started training
    spent: float = 0.0
    commit_seconds: float | None = None  # the last commit of weights; None: none yet

    def due(self, now: float) -> bool:
        if self.fraction <= 0 or self.commit_seconds is None:
            return True
        return self.spent + self.commit_seconds <= self.fraction * (now - self.started)

    def spend(self, seconds: float, *, weights: bool) -> None:
        self.spent += seconds
        if weights:
            self.commit_seconds = seconds


@dataclass(frozen=True)
class EpochOutcome:
    """One epoch's metrics and what the workers agreed with them (one collective)."""

    metrics: dict[str, float]
    stop_requested: bool  # the run's stop file exists (on some worker)
    commit_due: bool  # rank 0's checkpoint budget has room for this epoch's weights


def precision_context(precision: str, device: torch.device) -> Any:
    """The autocast context of the training and evaluation forwards (a no-op for fp32)."""
    import torch

    dtype = PRECISIONS[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=getattr(torch, dtype))


def apply_strategy(
    model: torch.nn.Module,
    strategy: str,
    device: torch.device,
    prepare_ddp: Any,
    *,
    mesh: DeviceMesh | None = None,
) -> torch.nn.Module:
    """``model`` on ``device``, wrapped for data-parallel training by ``strategy``.

    ``fsdp`` shards every top-level child that holds parameters, then the root, with FSDP2's
    ``fully_shard`` over all workers (gloo on CPU, NCCL on GPUs); ``ddp`` uses ``prepare_ddp``
    (Ray Train's ``prepare_model``). ``tp`` and ``pp`` split the model over the ``(dp, tp|pp)``
    ``mesh`` (:mod:`integrations.model_parallel`): tensor-parallel layers, or this rank's
    pipeline stage, FSDP2-sharded over ``dp``. Outside a process group the model trains
    unwrapped.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return model.to(device)
    if strategy == "tp" and mesh is not None:
        return model_parallel.parallelize_tensors(model.to(device), mesh)
    if strategy == "pp" and mesh is not None:
        return model_parallel.pipeline_stage_module(model, mesh, device)
    if strategy == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        model = model.to(device)
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for child in model.children():
            if next(child.parameters(), None) is not None:
                fully_shard(child, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    return prepare_ddp(model) if prepare_ddp else model.to(device)


class EpochCommitter:
    """The background writer: commits each epoch's checkpoint while training carries on.

    Gathered checkpoints: rank 0's committer gets the checkpoint's files as bytes, or a CPU
    copy of the state that it serialises (:class:`StagedSnapshot`). Sharded
    ones: every rank's committer gets its :class:`ShardedSnapshot`, writes its own shards, and
    rank 0's commits them all (``distributed_checkpoint.commit_sharded``, whose collectives
    run on the snapshot's checkpoint group). One commit is in flight at a time on each rank,
    so commits stay in order, every rank's collectives come in the same order, and memory
    stays bounded. An epoch submitted without files commits its metrics only (the checkpoint
    budget's, see :func:`train_epochs`); :meth:`submit_weights` adds its weights later. After
    each commit of weights the retention policy, if any, prunes the checkpoints it does not
    keep, except early stopping's best epoch (whose weights are the run's result). ``history``
    holds the metrics of the epochs committed before this committer started (a resumed run's).
    Workers never write metrics anywhere else: the driver turns committed checkpoints into
    MLflow history (see ``tasks.train.EpochRecorder``), which keeps MLflow's client work off
    the training process's interpreter lock.
    """

    def __init__(
        self,
        store: CheckpointStore,
        retention: RetentionPolicy | None = None,
        *,
        early_stopping: EarlyStopping | None = None,
        history: History | None = None,
    ) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._store, self._retention = store, retention
        self._early_stopping = early_stopping
        self._history = {epoch: dict(metrics) for epoch, metrics in (history or {}).items()}
        self.committed_epoch = 0  # the newest epoch this committer committed
        # This epoch's mid-epoch commits so far, and the time they blocked the loop.
        self.mid_epoch_checkpoints, self._mid_epoch_blocking = 0, 0.0
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self._in_flight: Future[str | None] | None = None
        # The metrics files of epochs committed without weights, for a later commit of them.
        self._metrics_only: dict[int, dict[str, bytes]] = {}

    def submit(
        self,
        epoch: int,
        files: Snapshot | None,
        metrics: dict[str, float],
        *,
        epoch_started: float,
        blocked_since: float,
    ) -> float:
        """Queue one epoch (``files`` None: its metrics only, no resume point); the loop was
        blocked from ``blocked_since`` until this returns. Returns what checkpointing blocked
        the loop for this epoch (its ``checkpoint_blocking_seconds``)."""
        self.wait()
        now = time.perf_counter()
        # What checkpointing cost the loop: the snapshots (this epoch's mid-epoch ones too)
        # plus waiting for the previous commits.
        blocking = now - blocked_since + self._mid_epoch_blocking
        metrics = {
            **metrics,
            "checkpoint_blocking_seconds": blocking,
            "epoch_seconds": now - epoch_started,  # wall time of the whole epoch on rank 0
            "mid_epoch_checkpoints": self.mid_epoch_checkpoints,  # by this worker group
            "checkpoint_weights": float(files is not None),  # 0: metrics only (the budget's)
        }
        self.mid_epoch_checkpoints, self._mid_epoch_blocking = 0, 0.0
        small = {METRICS_FILE: json.dumps(metrics).encode()}
        if files is None:
            self._metrics_only[epoch] = small
            self._in_flight = self._executor.submit(
                self._commit, epoch, small, metrics, metrics_only=True
            )
        else:
            self._in_flight = self._executor.submit(
                self._commit, epoch, _with_files(files, small), metrics
            )
        return blocking

    def submit_weights(self, epoch: int, files: Snapshot) -> None:
        """Queue the weights of ``epoch``, whose metrics were committed alone before (a best
        epoch kept in memory), beside those same metrics."""
        self.wait()
        small = self._metrics_only.pop(epoch, {})  # none on ranks that commit no metrics
        self._in_flight = self._executor.submit(
            self._commit, epoch, _with_files(files, small), None
        )

    def submit_step(
        self,
        epoch: int,
        step: int,
        files: Snapshot,
        *,
        blocked_since: float,
    ) -> None:
        """Queue a checkpoint taken ``step`` steps into ``epoch`` (no metrics: the epoch has
        not ended); its blocking time counts in the epoch's ``checkpoint_blocking_seconds``."""
        self.wait()
        self._in_flight = self._executor.submit(self._commit, epoch, files, None, step)
        self.mid_epoch_checkpoints += 1
        self._mid_epoch_blocking += time.perf_counter() - blocked_since

    def _commit(
        self,
        epoch: int,
        files: Snapshot,
        metrics: dict[str, float] | None,  # None: a mid-epoch checkpoint, or a best epoch's
        step: int | None = None,
        metrics_only: bool = False,
    ) -> str | None:
        if isinstance(files, StagedSnapshot):
            files = files.files()
        if isinstance(files, ShardedSnapshot):  # None on ranks other than 0
            url = distributed_checkpoint.commit_sharded(self._store, epoch, files, step=step)
        else:
            url = self._store.save(epoch, files, step=step, metrics_only=metrics_only)
        if metrics is not None:
            self._history[epoch] = metrics
            if not metrics_only:
                self.committed_epoch = epoch
        if self._retention is not None and url is not None and not metrics_only:  # rank 0
            self._store.prune(self._retention, also_keep=self._pinned())
        return url

    def _pinned(self) -> frozenset[int]:
        """Epochs whose weights stay whatever the retention policy says: early stopping's best."""
        if self._early_stopping is None:
            return frozenset()
        best = self._early_stopping.best(self._history)
        return frozenset() if best is None else frozenset({best.epoch})

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


def _with_files(files: Snapshot, small: dict[str, bytes]) -> Snapshot:
    """``files`` with the small files ``small`` added (the coordinator's, when sharded)."""
    if isinstance(files, ShardedSnapshot):
        return dataclasses.replace(files, files={**files.files, **small})
    if isinstance(files, StagedSnapshot):
        return dataclasses.replace(files, small={**files.small, **small})
    return {**files, **small}


def evaluate_batches(
    model: torch.nn.Module | model_parallel.Pipeline,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    device: torch.device,
    problem: problems.Problem,
) -> list[torch.Tensor]:
    """The task's summed validation statistics of ``model`` on the given batches; the sums stay
    on the device (no host sync per batch) until the epoch's one all-reduce reads them."""
    import torch

    sums = [
        torch.zeros((), dtype=torch.float64, device=device) for _ in range(problem.validation_width)
    ]  # also what a worker with no validation rows adds
    model.eval()
    with torch.no_grad():
        for features, targets in batches:
            outputs = model(features)
            if outputs is None:  # a pipeline stage before the last: the last one adds them
                continue
            batch = problem.validation_sums(outputs, targets)
            sums = [total + part for total, part in zip(sums, batch, strict=True)]
    return sums


class EpochTrainer:
    """One worker's model, optimiser and data shard, trained one epoch at a time.

    Shared by Ray Train workers (``train_loop_per_worker``, DDP or FSDP) and campaign trials that
    train in one warm process. It resumes from the newest verified checkpoint in
    ``checkpoint_url``, whatever strategy and worker count wrote it.
    """

    def __init__(
        self,
        config: TrainLoop,
        *,
        rank: int = 0,
        world_size: int = 1,
        device: torch.device | None = None,
        prepare_model: Any = None,
        shards: dict[str, Shard] | None = None,
    ) -> None:
        import torch

        from prefect_ml.integrations import devices

        self.config, self.rank, self.world_size = config, rank, world_size
        self.layout = model_parallel.MeshLayout.of(config.training, world_size)
        # The ranks of one model replica (a tensor-parallel group, a pipeline) read the same
        # shard in the same order; one of them reports the replica's metrics.
        self.data_rank = self.layout.data_rank(rank)
        self.data_world_size = self.layout.data_parallel
        self.reports = self.layout.reports(rank)
        self.problem = problems.problem(config.data.task)
        self.device = device or torch.device("cpu")
        collectives.check_group_device(self.device)
        check_precision(config.training.precision, self.device)
        torch.manual_seed(
            epoch_seed(config.training.seed, 0, 0)
        )  # the same initial weights everywhere
        model = build_model(
            config.model.model,
            config.data.sample_shape,
            config.data.num_classes,
            config.model.factory_options(),
        )
        # A model with its own steps (integrations.hooks) trains through them; any other
        # through the task's loss and metrics.
        self.hooked = hooks.is_hooked(model)
        if self.hooked:
            hooks.check_contract(model, strategy=config.training.strategy)
        if config.training.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        self.loss = hooks.loss_function(model, self.problem)
        self.extra_metrics = hooks.metrics_function(model)
        self.network = model  # what forward() runs: validation, evaluation and serving
        self.pipeline: model_parallel.Pipeline | None = None  # pp: this rank's stage
        # What the model's self.log records, and the loop as a LightningModule sees it.
        self.step_log = step_log.StepLog(self.device)
        self.loop_state: hooks.LoopState | None = None
        if self.hooked:  # DDP wraps the steps; checkpoints hold the network's own state
            model.to(self.device)  # a LightningModule's own .to() keeps its self.device right
            self.model = apply_strategy(hooks.step_module(model), "ddp", self.device, prepare_model)
            self.state_module = model
        else:
            model_parallel.check_precision(config.training)
            mesh = self.layout.build(self.device) if self.layout.model_parallel > 1 else None
            self.model = apply_strategy(
                model, config.training.strategy, self.device, prepare_model, mesh=mesh
            )
            self.network = self.state_module = self.model
            if config.training.strategy == "pp" and mesh is not None:
                self.pipeline = model_parallel.Pipeline(
                    self.model,
                    mesh,
                    self.device,
                    self.loss,
                    microbatches=config.training.pipeline_microbatches,
                    schedule=config.training.pipeline_schedule,
                )
        self.communication: model_parallel.Communication | None = None  # of one step, tp/pp
        # A RuntimeError in the forward of this process's first step is the model's own (a
        # shape its layers do not take): the same on every retry, so it ends the run.
        self.stepped = False
        shards = shards or {
            split: open_shard(
                config.data.splits_url,
                config.data.layout,
                split,
                tuple(config.data.sample_shape),
                self.data_rank,
                self.data_world_size,
            )
            for split in ("train", "val")
        }
        self.train, self.val = shards["train"], shards["val"]
        self.steps_per_epoch = math.ceil(self.train.rows / config.training.batch_size)
        if self.hooked:
            self.loop_state = hooks.LoopState(
                max_epochs=config.training.epochs,
                num_training_batches=self.steps_per_epoch,
                world_size=world_size,
                global_rank=rank,
            )
            hooks.attach(model, self.step_log, self.loop_state)
        # The model's configure_optimizers() (any form Lightning accepts), else the flags'.
        configured = (
            optimization.configured(model) if hooks.defines(model, "configure_optimizers") else None
        )
        self.optimization = configured or optimization.default(
            make_optimizer(
                config.training.optimizer,
                self.model.parameters(),
                config.training.lr,
                config.training.weight_decay,
            ),
            config.training.scheduler,
            config.training.epochs,
        )
        self.optimizer = self.optimization.optimizer
        if self.loop_state is not None:
            self.loop_state.optimizers = [self.optimizer]
            self.loop_state.lr_scheduler_configs = self.optimization.schedulers
        # Loss scaling keeps small fp16 gradients from flushing to zero; bf16 has fp32's range.
        self.scaler = torch.amp.GradScaler(
            self.device.type, enabled=config.training.precision == "fp16"
        )
        self.store = CheckpointStore(config.checkpoint_url)
        # Sharded checkpoints coordinate on a gloo group of their own (created here, by every
        # rank in the same order); None for gathered ones.
        self.checkpoint_group = (
            distributed_checkpoint.checkpoint_group()
            if self.checkpoint_layout == "sharded"
            else None
        )
        self.first_epoch = 1
        self.resume: ResumePoint | None = None  # set by a mid-epoch checkpoint's restore
        self.peak_memory_kind = devices.peak_memory_kind(self.device)
        latest = self.store.latest()
        if latest is not None:
            self._restore(latest.files)
        # The task's own validation pass (forward, the task's loss and metrics) is skipped when
        # the model's validation_step already returns every metric of it.
        self.task_validation = not self.hooked or not self._steps_cover_the_task()
        self._last_checkpoint = time.perf_counter()  # the seconds cadence counts from here

    def _steps_cover_the_task(self) -> bool:
        """Whether the model's ``validation_step`` returns or logs every validation metric of
        the task (asked once, on two validation rows; what it logs there is forgotten)."""
        import torch

        if not hooks.defines(self.network, "validation_step"):
            return False
        rows = self._on_device(*self.val.head(2))
        batch = hooks.batch_of(self.network, *rows)
        was_training = self.network.training
        self.network.eval()
        with torch.no_grad(), self.step_log.hook("validation_step", len(rows[1])):
            found = self.network.validation_step(batch, 0)  # type: ignore[operator]
        returned = set(hooks.checked_metrics(found, self.network))
        logged = set(self.step_log.names())
        self.step_log.discard()
        self.network.train(was_training)
        task = {name for name in self.problem.epoch_metrics if name.startswith("val_")}
        return task <= returned | logged

    def _on_device(
        self, features: np.ndarray, labels: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A shard's features and its task's training targets, on this worker's device."""
        import torch

        targets = self.problem.targets(
            labels, self.config.data.target_mean, self.config.data.target_std
        )
        return (
            torch.from_numpy(features).to(self.device),
            torch.from_numpy(targets).to(self.device),
        )

    def _restore(self, files: Mapping[str, bytes | bytearray]) -> None:
        try:
            self._load_state(files, flatten=True)
        except CheckpointError:  # written before optimiser state was flattened per parameter
            self._load_state(files, flatten=False)
        trainer_state = json.loads(files[TRAINER_STATE_FILE])
        # One scheduler's state under "scheduler" before configure_optimizers' forms came.
        schedulers = trainer_state.get("schedulers", [trainer_state.get("scheduler")])
        self.optimization.load_state_dict([state for state in schedulers if state is not None])
        if self.loop_state is not None:
            self.loop_state.global_step = int(trainer_state.get("global_step", 0))
        if trainer_state.get("scaler"):
            self.scaler.load_state_dict(trainer_state["scaler"])
        epoch = int(trainer_state["epoch"])
        if trainer_state.get("step") is None:
            self.first_epoch = epoch + 1
            return
        self.first_epoch = epoch  # a mid-epoch checkpoint: that epoch continues
        self.resume = ResumePoint(
            epoch,
            int(trainer_state["step"]),
            int(trainer_state["world_size"]),
            int(trainer_state.get("data_world_size", trainer_state["world_size"])),
            trainer_state["ranks"],
        )

    def _load_state(self, files: Mapping[str, bytes | bytearray], *, flatten: bool) -> None:
        """The model and optimiser state of a checkpoint's DCP files, into this layout."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_state_dict,
            set_state_dict,
        )

        options = StateDictOptions(flatten_optimizer_state_dict=flatten)
        model_state, optimizer_state = get_state_dict(
            self.state_module, self.optimizer, options=options
        )
        distributed_checkpoint.load_files(
            files, {"model": model_state, "optimizer": optimizer_state}
        )
        set_state_dict(
            self.state_module,
            self.optimizer,
            model_state_dict=model_state,
            optim_state_dict=optimizer_state,
            options=options,
        )

    def train_epoch(self, epoch: int, committer: EpochCommitter | None = None) -> dict[str, float]:
        """Train one epoch, then evaluate: its metrics (see :meth:`run_epoch`)."""
        return self.run_epoch(epoch, committer).metrics

    def run_epoch(
        self,
        epoch: int,
        committer: EpochCommitter | None = None,
        budget: CheckpointBudget | None = None,
    ) -> EpochOutcome:
        """Train one epoch, then evaluate; metrics are summed (memory: maxed) over all workers,
        in one collective that also tells every worker whether a stop was requested and
        whether rank 0's ``budget`` has room for this epoch's weights (always, without one).

        With a step or seconds cadence (``checkpoint_every_steps``/``_seconds``) every worker
        snapshots inside the epoch when one is due, and rank 0 hands the files to ``committer``
        (the other ranks pass None). An epoch a mid-epoch checkpoint was restored from
        continues at the step after it.
        """
        import torch

        from prefect_ml.integrations import devices

        config, model = self.config, self.model
        devices.reset_peak_memory(self.device)
        started = time.perf_counter()
        model.train()
        order = EpochOrder(config.training.seed, epoch, self.data_rank)
        first_step, loss_sum = self._epoch_start(epoch, order)  # loss summed on the device
        steps = self.steps_per_epoch
        lr = self.optimization.lr  # the rate this epoch starts with
        if self.loop_state is not None:
            self.loop_state.current_epoch, self.loop_state.training = epoch - 1, True
            try:
                hooks.call_hook(self.network, "on_train_epoch_start", self.step_log)
            except RuntimeError as exc:  # before the first step: the model's own, every time
                if self.stepped:
                    raise
                raise ModelStepError(
                    f"the model {config.model.model}'s on_train_epoch_start failed before its "
                    f"first training step: {exc}. Fix the hook"
                ) from exc
        batches = self.train.batches(
            config.training.batch_size, order, self._on_device, skip=first_step
        )
        for step, (features, targets) in enumerate(batches, start=first_step):
            loss_sum += self._train_step(step, features, targets) * len(targets)
            if step + 1 < steps and self._checkpoint_due(step + 1):  # the end commits anyway
                blocked_since = time.perf_counter()
                files = self.snapshot(epoch, step=step + 1, loss_sum=loss_sum)
                if committer is not None:
                    committer.submit_step(epoch, step + 1, files, blocked_since=blocked_since)
        train_seconds = time.perf_counter() - started
        val_batch = max(config.training.batch_size, 256)
        with precision_context(config.training.precision, self.device):
            val_sums = (
                evaluate_batches(
                    self.pipeline or self.network,
                    self.val.batches(val_batch, None, self._on_device),
                    self.device,
                    self.problem,
                )
                if self.task_validation
                else []
            )
            model_sums = self._model_validation(val_batch)
            if self.loop_state is not None:
                hooks.call_hook(self.network, "on_train_epoch_end", self.step_log)
        # One rank per model replica adds its rows and validation sums (its loss sum is its
        # steps' losses: zero on the others, see _train_step), so the metrics are DDP's.
        share = 1.0 if self.reports else 0.0
        summed: list[float | torch.Tensor] = [
            self.train.rows * share,
            self.val.rows * share,
            train_seconds,
            loss_sum,
            *(part * share for part in val_sums),
            *(part * share for part in model_sums.values()),
        ]
        # The epoch's one collective: the sums above, each rank's own numbers, and what the
        # workers must agree on (a stop request anywhere; rank 0's checkpoint budget).
        sent = self.communication or model_parallel.Communication()
        stop = bool(config.stop_url) and storage.exists(config.stop_url)
        due = self.rank == 0 and (budget is None or budget.due(time.perf_counter()))
        rows = collectives.all_gather(
            [
                *summed,
                devices.peak_memory_bytes(self.device),
                train_seconds / max(1, steps - first_step),
                sent.collectives,
                sent.p2p_bytes,
                float(self.step_log.logged_any),
                float(stop),
                float(due),
            ],
            self.device,
        )
        columns = zip(*(row[: len(summed)] for row in rows), strict=True)
        train_rows, val_rows, seconds, *totals = [sum(column) for column in columns]
        model_metrics = dict(zip(model_sums, totals[1 + len(val_sums) :], strict=True))
        logged = (
            step_log.combine([json.loads(p) for p in collectives.gather_strings(self._logged())])
            if any(row[-3] > 0 for row in rows)  # one more collective, for models that log
            else {}
        )
        metrics = {
            "train_loss": totals[0] / train_rows,
            **(
                self.problem.validation_metrics(
                    totals[1 : 1 + len(val_sums)], val_rows, config.data.target_std
                )
                if val_sums
                else {}
            ),
            **{name: total / val_rows for name, total in model_metrics.items()},
            **logged,
            "lr": lr,
            "samples_per_second": train_rows / (seconds / self.world_size),
            **self._per_rank_metrics([row[len(summed) : len(summed) + 4] for row in rows]),
            "workers": self.world_size,  # elastic groups change size between restarts
        }
        self.optimization.after_epoch(epoch, steps, metrics)
        if self.loop_state is not None:
            self.loop_state.callback_metrics = {k: torch.tensor(v) for k, v in metrics.items()}
            self.loop_state.training = False
        return EpochOutcome(
            metrics,
            stop_requested=any(row[-2] > 0 for row in rows),
            commit_due=rows[0][-1] > 0,
        )

    def _logged(self) -> str:
        """What this worker's model logged this epoch, as JSON for the epoch's gather."""
        return json.dumps(self.step_log.take())

    def _per_rank_metrics(self, rows: list[list[float]]) -> dict[str, float]:
        """From each rank's peak memory, mean step time and what one step communicated (rank
        order): the largest peak as ``peak_memory_mib``, each rank's peak and step time, and
        under tp/pp the collectives a rank joins (the most of any rank) and the pipeline's
        point-to-point bytes (all ranks)."""
        metrics = {"peak_memory_mib": max(row[0] for row in rows) / 2**20}  # the largest worker's
        for rank, (peak, seconds, _, _) in enumerate(rows):
            metrics[f"peak_memory_mib_rank{rank}"] = peak / 2**20
            metrics[f"step_seconds_rank{rank}"] = seconds
        if (
            self.config.training.strategy in model_parallel.SIZE_FIELDS
            and self.layout.model_parallel > 1
        ):
            metrics["collectives_per_step"] = max(row[2] for row in rows)
            metrics["p2p_bytes_per_step"] = sum(row[3] for row in rows)
        return metrics

    def _epoch_start(self, epoch: int, order: EpochOrder) -> tuple[int, torch.Tensor]:
        """The step ``epoch`` starts at and its running train-loss sum, with torch's RNG set
        to match: step 0, a zero sum and the epoch's seed, or where a restored mid-epoch
        checkpoint left them.

        With the worker count that wrote the checkpoint, each rank takes back its own RNG
        state and loss sum: the epoch goes on exactly as it would have. With another count
        the shards differ, so it starts at the step that covers the same share of the epoch's
        samples, with the epoch's seed and the loss summed so far on rank 0.
        """
        import torch

        resume, self.resume = self.resume, None
        loss_sum = torch.zeros((), device=self.device)
        if resume is None or resume.epoch != epoch:
            torch.manual_seed(order.worker_seed)
            return 0, loss_sum
        layout = (resume.world_size, resume.data_world_size)
        if layout != (self.world_size, self.data_world_size):
            torch.manual_seed(order.worker_seed)
            if self.rank == 0:
                loss_sum += sum(float(rank["loss_sum"]) for rank in resume.ranks)
            return resume.step * resume.data_world_size // self.data_world_size, loss_sum
        state = resume.ranks[self.rank]
        torch.set_rng_state(_tensor_of(state["rng"]))
        if state.get("cuda_rng") and self.device.type == "cuda":
            torch.cuda.set_rng_state(_tensor_of(state["cuda_rng"]), self.device)
        loss_sum += float(state["loss_sum"])
        return resume.step, loss_sum

    @property
    def scheduler(self) -> Any:
        """The first learning-rate scheduler (the training section's, for a model without
        ``configure_optimizers``), or None."""
        schedulers = self.optimization.schedulers
        return schedulers[0].scheduler if schedulers else None

    def _checkpoint_due(self, steps_done: int) -> bool:
        """Whether a checkpoint is due after ``steps_done`` steps of the epoch; the same answer
        on every worker (a snapshot is a collective), from rank 0's clock for the seconds
        cadence (one tiny all-reduce a step, only when that cadence is on)."""
        config = self.config
        every = config.training.checkpoint_every_steps
        due = every > 0 and steps_done % every == 0
        if config.training.checkpoint_every_seconds > 0:
            elapsed = time.perf_counter() - self._last_checkpoint
            late = self.rank == 0 and elapsed >= config.training.checkpoint_every_seconds
            due = collectives.any_worker(late, self.device) or due
        return due

    def _rank_resume_state(self, loss_sum: torch.Tensor) -> dict[str, Any]:
        """This rank's share of a mid-epoch checkpoint: torch's RNG states and its loss sum."""
        import torch

        cuda = self.device.type == "cuda"
        return {
            "rng": _text_of(torch.get_rng_state()),
            "cuda_rng": _text_of(torch.cuda.get_rng_state(self.device)) if cuda else None,
            "loss_sum": float(loss_sum),  # a float32 sum: exact as a Python float
        }

    def _train_step(self, step: int, features: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One optimiser step on one batch; the batch's mean loss, detached, on the device
        (zero on the ranks of a model replica that do not report it: see ``reports``).

        Under tp and pp the trainer's first step is measured (:func:`model_parallel.measured`)
        for the communication it reports."""
        if self.communication is None and self.layout.model_parallel > 1:
            with model_parallel.measured(self.pipeline) as measured:
                loss = self._optimizer_step(step, features, targets)
            self.communication = measured[0]
            return loss
        return self._optimizer_step(step, features, targets)

    def _optimizer_step(
        self, step: int, features: torch.Tensor, targets: torch.Tensor
    ) -> torch.Tensor:
        model, scaler = self.model, self.scaler
        self.optimizer.zero_grad(set_to_none=True)
        if self.pipeline is not None:  # forward and backward run inside the schedule
            with precision_context(self.config.training.precision, self.device):
                loss = self.pipeline.train_step(features, targets)
            self.optimizer.step()
            return loss
        try:
            with precision_context(self.config.training.precision, self.device):
                if self.hooked:
                    self.step_log.enter("training_step", len(targets))
                    returned = model(hooks.batch_of(self.network, features, targets), step)
                    self.step_log.enter(None)
                    loss = hooks.step_loss(returned, self.network, checked=not self.stepped)
                else:
                    loss = self.loss(model(features), targets)
        except RuntimeError as exc:
            if self.stepped:
                raise
            raise ModelStepError(
                f"the model {self.config.model.model} failed its first training step on this "
                f"worker (a batch of shape {list(features.shape)}, the data's sample shape "
                f"{list(self.config.data.sample_shape)}): {exc}. Fix the model so that its forward "
                "and loss run on such a batch"
            ) from exc
        scaler.scale(loss).backward()
        scaler.step(self.optimizer)
        scaler.update()
        self.optimization.after_batch(step)
        if self.loop_state is not None:
            self.loop_state.global_step += 1
        self.stepped = True
        return loss.detach() if self.reports else loss.detach() * 0.0

    def _model_validation(self, batch_size: int) -> dict[str, torch.Tensor]:
        """The metrics the model adds (its ``validation_step``, or ``compute_metrics`` of its
        outputs), summed weighted by batch size on the device (the epoch's all-reduce adds the
        workers' up); empty for a model without either hook."""
        import torch

        validates = self.hooked and hooks.defines(self.network, "validation_step")
        if not (validates or self.extra_metrics):
            return {}
        sums: dict[str, torch.Tensor] = {}
        self.model.eval()
        if self.loop_state is not None:
            self.loop_state.validating = True
            hooks.call_hook(self.network, "on_validation_epoch_start", self.step_log)
        with torch.no_grad():
            batches = self.val.batches(batch_size, None, self._on_device)
            for batch_idx, (features, targets) in enumerate(batches):
                if validates:
                    batch = hooks.batch_of(self.network, features, targets)
                    with self.step_log.hook("validation_step", len(targets)):
                        found = self.model(batch, batch_idx, True)
                    metrics = hooks.checked_metrics(found, self.network)
                else:
                    assert self.extra_metrics is not None
                    outputs = (self.pipeline or self.network)(features)
                    if outputs is None:  # a pipeline stage before the last
                        continue
                    found = self.extra_metrics(outputs, targets)
                    metrics = hooks.checked_metrics(found, self.network, "compute_metrics")
                for name, value in metrics.items():
                    weighted = value * len(targets)
                    sums[name] = sums[name] + weighted if name in sums else weighted
        if self.loop_state is not None:
            hooks.call_hook(self.network, "on_validation_epoch_end", self.step_log)
            self.loop_state.validating = False
        return sums

    @property
    def checkpoint_layout(self) -> str:
        """``"sharded"`` or ``"gathered"`` (``distributed_checkpoint.resolve_layout``)."""
        import torch.distributed as dist

        grouped = dist.is_available() and dist.is_initialized()
        return distributed_checkpoint.resolve_layout(
            self.config.training.checkpoint_layout,
            "ddp" if self.hooked else self.config.training.strategy,
            self.world_size if grouped else 1,
        )

    @property
    def writes_checkpoints(self) -> bool:
        """Whether this rank commits checkpoints (an :class:`EpochCommitter` of its own): rank 0,
        and every rank when they are sharded."""
        return self.rank == 0 or self.checkpoint_group is not None

    def snapshot(
        self,
        epoch: int,
        *,
        step: int | None = None,
        loss_sum: torch.Tensor | None = None,
        staged: bool = False,
    ) -> Snapshot:
        """The training state after ``epoch`` (or after ``step`` steps of it, with the epoch's
        running ``loss_sum``) as checkpoint files; empty on ranks other than 0. Sharded: every
        rank's CPU copy of its own part, for its committer to write; ``staged`` takes a gathered
        one as a CPU copy too (:class:`StagedSnapshot`), serialised when it is committed.

        Every worker must call it: under FSDP, gathering the full state is a collective, and a
        mid-epoch snapshot gathers every rank's RNG state and loss sum to rank 0.
        """
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        resume: dict[str, Any] = {}
        if step is not None:
            if loss_sum is None:
                raise ValueError("a mid-epoch snapshot needs the epoch's running loss_sum")
            gathered = collectives.gather_strings(json.dumps(self._rank_resume_state(loss_sum)))
            ranks = [json.loads(rank) for rank in gathered]
            resume = {
                "step": step,
                "world_size": self.world_size,
                "data_world_size": self.data_world_size,
                "ranks": ranks,
            }
        sharded = self.checkpoint_group is not None
        full = dist.is_available() and dist.is_initialized() and not sharded  # gathered
        model_state, optimizer_state = get_state_dict(
            self.state_module,
            self.optimizer,
            # Flattened: every optimiser value (param groups too) under its parameter's name,
            # so pipeline stages, which hold different parameters, never write the same key.
            options=StateDictOptions(
                full_state_dict=full, cpu_offload=full, flatten_optimizer_state_dict=True
            ),
        )
        self._last_checkpoint = time.perf_counter()  # the seconds cadence counts from here
        if self.rank != 0 and not sharded:
            return {}
        state = {"model": model_state, "optimizer": optimizer_state}
        trainer_state = {
            "epoch": epoch,
            "seed": self.config.training.seed,
            "schedulers": self.optimization.state_dict(),
            "global_step": self.loop_state.global_step if self.loop_state else 0,
            "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else None,
            **resume,
        }
        small = {TRAINER_STATE_FILE: json.dumps(trainer_state).encode()} if self.rank == 0 else {}
        if self.checkpoint_group is not None:
            return ShardedSnapshot.take(state, small, self.checkpoint_group)
        if staged:
            from torch.distributed.checkpoint.staging import BlockingAsyncStager

            return StagedSnapshot(BlockingAsyncStager().stage(state), small)
        return {**distributed_checkpoint.to_files(state), **small}

    def committed_metrics(self) -> dict[int, dict[str, float]]:
        """Metrics of every verified epoch before ``first_epoch`` (a resumed run's history)."""
        return committed_history(self.store, self.first_epoch - 1)


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


def check_precision(precision: str, device: torch.device) -> None:
    """Refuse a precision the worker's device cannot train in, before the first step."""
    import torch

    if precision == "fp16" and device.type == "cpu":
        raise ConfigurationError(
            "training.precision",
            "fp16 needs a GPU (its gradient scaler and kernels are GPU features); "
            "use --precision bf16 on CPU, or --use-gpu",
        )
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigurationError(
            "training.precision",
            f"{torch.cuda.get_device_name(device)} has no bf16 support; use --precision fp16",
        )


def stop_requested(stop_url: str, device: torch.device) -> bool:
    """Whether someone asked this run to stop (a pruned trial); every worker agrees."""
    return collectives.any_worker(bool(stop_url) and storage.exists(stop_url), device)


def stopped_early(
    early_stopping: EarlyStopping | None, history: History, device: torch.device
) -> bool:
    """Whether the monitored metric stopped improving (early stopping); every worker agrees."""
    if early_stopping is None:
        return False
    return collectives.any_worker(early_stopping.decide(history) is not None, device)


def check_monitored(training: TrainingParams, metrics: Mapping[str, float]) -> None:
    """Refuse, after an epoch, an early-stopping or best-checkpoint metric that the epoch did
    not produce (a name the model never logged), as Lightning's callbacks do."""
    watched = []
    if training.early_stopping() is not None:
        watched.append(("training.early_stopping_metric", training.early_stopping_monitor))
    if training.best_checkpoint_metric != "none":
        watched.append(("training.best_checkpoint_metric", training.best_checkpoint_metric))
    for field, metric in watched:
        if metric not in metrics:
            names = sorted(name for name in metrics if name.startswith(("train", "val")))
            raise ConfigurationError(
                field,
                f"{metric!r} is not among the epoch's metrics {names}; name one of them, or "
                "log it from the model's steps with self.log",
            )


def train_epochs(trainer: EpochTrainer) -> None:
    """A worker group's training: epochs from ``trainer.first_epoch`` until the last one, a stop
    request or early stopping, each committing a checkpoint.

    An epoch commits its weights when rank 0's :class:`CheckpointBudget` has room for them
    (``checkpoint_budget``), and the last epoch trained always does; any other commits its
    metrics only, so every epoch's metrics reach MLflow, and a run resumed after it replays it
    from the last epoch with weights, in the same data order. The best epoch (of
    ``best_tracker``) keeps its weights as a CPU copy until the next commit of
    weights, which commits it first: a run that fails before that replays it too. Every rank
    takes the same branch: the budget's answer, the stop request and the metrics all come from
    the epoch's one collective (:meth:`EpochTrainer.run_epoch`).
    """
    config = trainer.config
    early_stopping, tracker = config.training.early_stopping(), best_tracker(config.training)
    # A resumed group decides from the committed epochs' metrics, as the first group would have.
    history = trainer.committed_metrics() if tracker else {}
    committer = (
        EpochCommitter(
            trainer.store,
            retention(config.training),
            early_stopping=early_stopping,
            history=history,
        )
        if trainer.writes_checkpoints  # rank 0; every rank when checkpoints are sharded
        else None
    )
    stopped = stop_requested(config.stop_url, trainer.device) or stopped_early(
        early_stopping, history, trainer.device
    )
    budget = CheckpointBudget(config.training.checkpoint_budget, started=time.perf_counter())
    best: tuple[int, Snapshot] | None = None  # a best epoch committed without its weights
    for epoch in range(
        config.training.epochs + 1 if stopped else trainer.first_epoch, config.training.epochs + 1
    ):
        started = time.perf_counter()
        outcome = trainer.run_epoch(epoch, committer, budget)
        history[epoch] = outcome.metrics  # from the collective: the same on every worker
        check_monitored(config.training, outcome.metrics)
        last = (
            epoch == config.training.epochs
            or outcome.stop_requested
            or (early_stopping is not None and early_stopping.decide(history) is not None)
        )
        weights = outcome.commit_due or last
        best_epoch = tracker.best(history) if tracker else None
        new_best = best_epoch is not None and best_epoch.epoch == epoch
        if new_best:
            best = None  # a better epoch came: its weights are kept instead
        blocked_since = time.perf_counter()
        if weights and best is not None:
            if committer is not None:
                committer.submit_weights(*best)
            best = None
        # The snapshot (rank 0's CPU copy of the state, or each rank's of its shards; every
        # worker takes it) is the only part that blocks: serialising, hashing and writing
        # happen in the background.
        files = None
        if weights or new_best:
            snapshot = trainer.snapshot(epoch, staged=True)
            if weights:
                files = snapshot
            else:
                best = (epoch, snapshot)
        if committer is not None and (weights or trainer.rank == 0):
            blocking = committer.submit(
                epoch,
                files,
                outcome.metrics,
                epoch_started=started,
                blocked_since=blocked_since,
            )
            budget.spend(blocking, weights=weights)
        if last:
            break
    if committer is not None:
        committer.close()


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
    distributed_checkpoint.load_files(latest.files, state)
    model.load_state_dict(state["model"])
    return model.eval(), latest.epoch
