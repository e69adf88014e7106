"""One worker's training, an epoch at a time: the model built and wrapped by its strategy
(:mod:`._strategy`), its data shards, the step (:mod:`._step`), the validation pass
(:mod:`._evaluation`), the epoch's one collective, and the snapshots a committer commits
(:mod:`._commit`), restored on resume (:mod:`._resume`).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from prefect_ml.integrations import problems, storage
from prefect_ml.integrations.config.loop import TrainLoop
from prefect_ml.integrations.datasets import (
    EpochOrder,
    Shard,
    build_model,
    enable_gradient_checkpointing,
    epoch_seed,
    open_shard,
)
from prefect_ml.integrations.errors import ModelStepError
from prefect_ml.integrations.storage import CheckpointStore
from prefect_ml.integrations.training import (
    _collectives,
    _distributed_checkpoint,
    _hooks,
    _model_parallel,
    _optimization,
    _step_log,
)
from prefect_ml.integrations.training._commit import (
    TRAINER_STATE_FILE,
    CheckpointBudget,
    EpochCommitter,
    Snapshot,
    packaged,
    training_state,
)
from prefect_ml.integrations.training._evaluation import ModelValidation, evaluate_batches
from prefect_ml.integrations.training._optimization import make_optimizer
from prefect_ml.integrations.training._resume import (
    ResumePoint,
    committed_history,
    epoch_start,
    mid_epoch_state,
    restore,
)
from prefect_ml.integrations.training._step import Stepper, check_precision, precision_context
from prefect_ml.integrations.training._strategy import wrap

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class EpochOutcome:
    """One epoch's metrics and what the workers agreed with them (one collective)."""

    metrics: dict[str, float]
    stop_requested: bool  # the run's stop file exists (on some worker)
    commit_due: bool  # rank 0's checkpoint budget has room for this epoch's weights


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

        from prefect_ml.integrations import compute

        self.config, self.rank, self.world_size = config, rank, world_size
        self.layout = _model_parallel.MeshLayout.of(config.training, world_size)
        # The ranks of one model replica (a tensor-parallel group, a pipeline) read the same
        # shard in the same order; one of them reports the replica's metrics.
        self.data_rank = self.layout.data_rank(rank)
        self.data_world_size = self.layout.data_parallel
        self.reports = self.layout.reports(rank)
        self.problem = problems.problem(config.data.task)
        self.device = device or torch.device("cpu")
        _collectives.check_group_device(self.device)
        check_precision(config.training.precision, self.device)
        model = self._built_model()
        # A model with its own steps (integrations.training) trains through them; any other
        # through the task's loss and metrics.
        self.hooked = _hooks.is_hooked(model)
        self.loss = _hooks.loss_function(model, self.problem)
        self.extra_metrics = _hooks.metrics_function(model)
        # What the model's self.log records, and the loop as a LightningModule sees it.
        self.step_log = _step_log.StepLog(self.device)
        wrapped = wrap(
            model, config.training, self.layout, self.device, prepare_model, loss=self.loss
        )
        self.model, self.network = wrapped.model, wrapped.network
        self.state_module, self.pipeline = wrapped.state_module, wrapped.pipeline
        self.train, self.val = self._opened(shards)
        self.steps_per_epoch = math.ceil(self.train.rows / config.training.batch_size)
        self._attach_loop(model)
        self.store = CheckpointStore(config.checkpoint_url)
        # Sharded checkpoints coordinate on a gloo group of their own (created here, by every
        # rank in the same order); None for gathered ones.
        self.checkpoint_group = (
            _distributed_checkpoint.checkpoint_group()
            if self.checkpoint_layout == "sharded"
            else None
        )
        self.first_epoch = 1
        self.resume: ResumePoint | None = None  # set by a mid-epoch checkpoint's restore
        self.peak_memory_kind = compute.peak_memory_kind(self.device)
        if (latest := self.store.latest()) is not None:
            self.first_epoch, self.resume = restore(
                latest.files, self.state_module, self.optimization, self.scaler, self.loop_state
            )
        # The task's own validation pass (forward, the task's loss and metrics) is skipped when
        # the model's validation_step already returns every metric of it.
        self.task_validation = not self.hooked or not self._steps_cover_the_task()
        self._last_checkpoint = time.perf_counter()  # the seconds cadence counts from here

    def _built_model(self) -> torch.nn.Module:
        """The model of the model section, with the same initial weights on every worker, its
        hooks' contract checked and gradient checkpointing on if asked."""
        import torch

        config = self.config
        torch.manual_seed(epoch_seed(config.training.seed, 0, 0))
        model = build_model(
            config.model.model,
            config.data.sample_shape,
            config.data.num_classes,
            config.model.factory_options(),
        )
        if _hooks.is_hooked(model):
            _hooks.check_contract(model, strategy=config.training.strategy)
        if config.training.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        return model

    def _opened(self, shards: dict[str, Shard] | None) -> tuple[Shard, Shard]:
        """This model replica's train and validation shards (``shards``, if given)."""
        data = self.config.data
        shards = shards or {
            split: open_shard(
                data.splits_url,
                data.layout,
                split,
                tuple(data.sample_shape),
                self.data_rank,
                self.data_world_size,
            )
            for split in ("train", "val")
        }
        return shards["train"], shards["val"]

    def _attach_loop(self, model: torch.nn.Module) -> None:
        """The optimiser and its schedules (the model's ``configure_optimizers()``, in any
        form Lightning accepts, else the training section's), the loss scaler, the loop as a
        hooked model sees it, and what runs the step and the model's validation."""
        import torch

        training = self.config.training
        self.loop_state: _hooks.LoopState | None = None
        if self.hooked:
            self.loop_state = _hooks.LoopState(
                max_epochs=training.epochs,
                num_training_batches=self.steps_per_epoch,
                world_size=self.world_size,
                global_rank=self.rank,
            )
            _hooks.attach(model, self.step_log, self.loop_state)
        configured = (
            _optimization.configured(model)
            if _hooks.defines(model, "configure_optimizers")
            else None
        )
        self.optimization = configured or _optimization.default(
            make_optimizer(
                training.optimizer, self.model.parameters(), training.lr, training.weight_decay
            ),
            training.scheduler,
            training.epochs,
        )
        self.optimizer = self.optimization.optimizer
        if self.loop_state is not None:
            self.loop_state.optimizers = [self.optimizer]
            self.loop_state.lr_scheduler_configs = self.optimization.schedulers
        # Loss scaling keeps small fp16 gradients from flushing to zero; bf16 has fp32's range.
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=training.precision == "fp16")
        self.stepper = Stepper(
            self.config,
            model=self.model,
            network=self.network,
            hooked=self.hooked,
            loss=self.loss,
            pipeline=self.pipeline,
            optimizing=self.optimization,
            scaler=self.scaler,
            device=self.device,
            log=self.step_log,
            loop_state=self.loop_state,
            reports=self.reports,
            measures=self.layout.model_parallel > 1,
        )
        self.validation = ModelValidation(
            self.model,
            self.network,
            self.pipeline,
            self.hooked,
            self.extra_metrics,
            self.step_log,
            self.loop_state,
        )

    def _steps_cover_the_task(self) -> bool:
        """Whether the model's ``validation_step`` returns or logs every validation metric of
        the task (asked once, on two validation rows)."""
        if not _hooks.defines(self.network, "validation_step"):
            return False
        return self.validation.covers_the_task(self.problem, self._on_device(*self.val.head(2)))

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

        from prefect_ml.integrations import compute

        compute.reset_peak_memory(self.device)
        started = time.perf_counter()
        self.model.train()
        order = EpochOrder(self.config.training.seed, epoch, self.data_rank)
        first_step, loss_sum = self._epoch_start(epoch, order)  # loss summed on the device
        lr = self.optimization.lr  # the rate this epoch starts with
        self._begin_epoch(epoch)
        self._train_batches(epoch, order, first_step, loss_sum, committer)
        train_seconds = time.perf_counter() - started
        val_batch = max(self.config.training.batch_size, 256)
        with precision_context(self.config.training.precision, self.device):
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
                _hooks.call_hook(self.network, "on_train_epoch_end", self.step_log)
        outcome = self._reduce(
            loss_sum,
            val_sums,
            model_sums,
            train_seconds=train_seconds,
            steps_run=self.steps_per_epoch - first_step,
            lr=lr,
            budget=budget,
        )
        self.optimization.after_epoch(epoch, self.steps_per_epoch, outcome.metrics)
        if self.loop_state is not None:
            self.loop_state.callback_metrics = {
                k: torch.tensor(v) for k, v in outcome.metrics.items()
            }
            self.loop_state.training = False
        return outcome

    def _begin_epoch(self, epoch: int) -> None:
        """The loop state and ``on_train_epoch_start`` of a hooked model."""
        if self.loop_state is None:
            return
        self.loop_state.current_epoch, self.loop_state.training = epoch - 1, True
        try:
            _hooks.call_hook(self.network, "on_train_epoch_start", self.step_log)
        except RuntimeError as exc:  # before the first step: the model's own, every time
            if self.stepper.stepped:
                raise
            raise ModelStepError(
                f"the model {self.config.model.model}'s on_train_epoch_start failed before its "
                f"first training step: {exc}. Fix the hook"
            ) from exc

    def _train_batches(
        self,
        epoch: int,
        order: EpochOrder,
        first_step: int,
        loss_sum: torch.Tensor,
        committer: EpochCommitter | None,
    ) -> None:
        """The epoch's steps from ``first_step``, adding each batch's loss to ``loss_sum`` (in
        place, on the device), with the mid-epoch checkpoints that come due."""
        steps, train_step = self.steps_per_epoch, self.stepper
        batches = self.train.batches(
            self.config.training.batch_size, order, self._on_device, skip=first_step
        )
        for step, (features, targets) in enumerate(batches, start=first_step):
            loss_sum += train_step(step, features, targets) * len(targets)
            if step + 1 < steps and self._checkpoint_due(step + 1):  # the end commits anyway
                blocked_since = time.perf_counter()
                files = self.snapshot(epoch, step=step + 1, loss_sum=loss_sum)
                if committer is not None:
                    committer.submit_step(epoch, step + 1, files, blocked_since=blocked_since)

    def _reduce(
        self,
        loss_sum: torch.Tensor,
        val_sums: list[torch.Tensor],
        model_sums: dict[str, torch.Tensor],
        *,
        train_seconds: float,
        steps_run: int,
        lr: float,
        budget: CheckpointBudget | None,
    ) -> EpochOutcome:
        """The epoch's one collective: the sums, each rank's own numbers, and what the workers
        must agree on (a stop request anywhere; rank 0's checkpoint budget)."""
        from prefect_ml.integrations import compute

        # One rank per model replica adds its rows and validation sums (its loss sum is its
        # steps' losses: zero on the others, see Stepper), so the metrics are DDP's.
        share = 1.0 if self.reports else 0.0
        summed: list[float | torch.Tensor] = [
            self.train.rows * share,
            self.val.rows * share,
            train_seconds,
            loss_sum,
            *(part * share for part in val_sums),
            *(part * share for part in model_sums.values()),
        ]
        sent = self.stepper.communication or _model_parallel.Communication()
        stop = bool(self.config.stop_url) and storage.exists(self.config.stop_url)
        due = self.rank == 0 and (budget is None or budget.due(time.perf_counter()))
        rows = _collectives.all_gather(
            [
                *summed,
                compute.peak_memory_bytes(self.device),
                train_seconds / max(1, steps_run),
                sent.collectives,
                sent.p2p_bytes,
                float(self.step_log.logged_any),
                float(stop),
                float(due),
            ],
            self.device,
        )
        return EpochOutcome(
            self._epoch_metrics(rows, len(summed), len(val_sums), list(model_sums), lr),
            stop_requested=any(row[-2] > 0 for row in rows),
            commit_due=rows[0][-1] > 0,
        )

    def _epoch_metrics(
        self, rows: list[list[float]], width: int, val_width: int, model_names: list[str], lr: float
    ) -> dict[str, float]:
        """The epoch's metrics from every rank's row of the collective (rank order): the first
        ``width`` columns summed, ``val_width`` of them the task's validation sums and then the
        model's own (``model_names``), and each rank's own numbers after them."""
        columns = zip(*(row[:width] for row in rows), strict=True)
        train_rows, val_rows, seconds, *totals = [sum(column) for column in columns]
        model_metrics = dict(zip(model_names, totals[1 + val_width :], strict=True))
        logged = (
            _step_log.combine([json.loads(p) for p in _collectives.gather_strings(self._logged())])
            if any(row[-3] > 0 for row in rows)  # one more collective, for models that log
            else {}
        )
        return {
            "train_loss": totals[0] / train_rows,
            **(
                self.problem.validation_metrics(
                    totals[1 : 1 + val_width], val_rows, self.config.data.target_std
                )
                if val_width
                else {}
            ),
            **{name: total / val_rows for name, total in model_metrics.items()},
            **logged,
            "lr": lr,
            "samples_per_second": train_rows / (seconds / self.world_size),
            **self._per_rank_metrics([row[width : width + 4] for row in rows]),
            "workers": self.world_size,  # elastic groups change size between restarts
        }

    def _model_validation(self, batch_size: int) -> dict[str, torch.Tensor]:
        """The metrics the model adds (:class:`ModelValidation`), summed weighted by batch size
        on the device; empty for a model without ``validation_step`` or ``compute_metrics``."""
        if not self.validation.adds_metrics:
            return {}
        return self.validation.sums(self.val.batches(batch_size, None, self._on_device))

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
            self.config.training.strategy in _model_parallel.SIZE_FIELDS
            and self.layout.model_parallel > 1
        ):
            metrics["collectives_per_step"] = max(row[2] for row in rows)
            metrics["p2p_bytes_per_step"] = sum(row[3] for row in rows)
        return metrics

    def _epoch_start(self, epoch: int, order: EpochOrder) -> tuple[int, torch.Tensor]:
        """The step ``epoch`` starts at and its running loss sum (:func:`._resume.epoch_start`);
        a restored mid-epoch checkpoint's point is used once."""
        resume, self.resume = self.resume, None
        return epoch_start(
            resume,
            epoch,
            order.worker_seed,
            self.device,
            rank=self.rank,
            layout=(self.world_size, self.data_world_size),
        )

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
            due = _collectives.any_worker(late, self.device) or due
        return due

    @property
    def checkpoint_layout(self) -> str:
        """``"sharded"`` or ``"gathered"`` (``distributed_checkpoint.resolve_layout``)."""
        import torch.distributed as dist

        grouped = dist.is_available() and dist.is_initialized()
        return _distributed_checkpoint.resolve_layout(
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
        resume: dict[str, Any] = {}
        if step is not None:
            if loss_sum is None:
                raise ValueError("a mid-epoch snapshot needs the epoch's running loss_sum")
            layout = (self.world_size, self.data_world_size)
            resume = mid_epoch_state(step, loss_sum, self.device, layout)
        sharded = self.checkpoint_group is not None
        state = training_state(self.state_module, self.optimizer, sharded=sharded)
        self._last_checkpoint = time.perf_counter()  # the seconds cadence counts from here
        if self.rank != 0 and not sharded:
            return {}
        trainer_state = {
            "epoch": epoch,
            "seed": self.config.training.seed,
            "schedulers": self.optimization.state_dict(),
            "global_step": self.loop_state.global_step if self.loop_state else 0,
            "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else None,
            **resume,
        }
        small = {TRAINER_STATE_FILE: json.dumps(trainer_state).encode()} if self.rank == 0 else {}
        return packaged(state, small, self.checkpoint_group, staged=staged)

    def committed_metrics(self) -> dict[int, dict[str, float]]:
        """Metrics of every verified epoch before ``first_epoch`` (a resumed run's history)."""
        return committed_history(self.store, self.first_epoch - 1)
