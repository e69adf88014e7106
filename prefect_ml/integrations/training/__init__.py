"""Training: the contract a user's model may implement, the per-worker loop that Ray Train
workers, campaign trials in one warm process and the GPU check run, the launch of a worker
group on Ray Train, and what the driver reads back from its checkpoints.

A model trains through the built-in loss and metrics of its task, or through its own steps
(``TrainingModule`` of :mod:`integrations.contracts`: ``training_step``, ``validation_step``,
``configure_optimizers``, Lightning's ``self.log``), checked on the driver before any worker
starts. Tensor and pipeline parallel models describe their split with ``ModelParallelHooks``.

The loop owns checkpointing through :class:`~integrations.storage.CheckpointStore`
(atomic, verified) instead of Ray Train's checkpoints, so that a restarted worker group, a
restarted process and a reader on another machine all resume from the same verified bytes.
Rank 0 commits one checkpoint per epoch, its metrics included; the driver logs those metrics
to MLflow once each. Under the checkpoint budget (``checkpoint_budget``, a share of training
time) an epoch whose weights do not fit commits its metrics only: a resumed run then replays
it from the last epoch with weights.

Checkpoints are ``torch.distributed.checkpoint`` (DCP) directories holding the model and
optimiser state under their plain parameter names (``get_state_dict`` strips the DDP and FSDP
wrappers), in one of two layouts (``training.checkpoint_layout``, resolved by
:func:`resolve_layout`): *gathered* (DDP, one process), where rank 0
gathers the full state and commits it, or *sharded* (FSDP, TP, PP by default), where every
rank writes its own shards and rank 0 commits the manifest that names them all, so no host
ever holds the whole model. Loading goes through DCP into the current layout, so a checkpoint
written by 2 FSDP workers restores into 3 DDP workers, into one campaign trial, or into a
plain model for evaluation.

Behind this face: the user's side, ``_hooks`` (the checks and calls of the ``TrainingModule``
contract), ``_optimization`` (``configure_optimizers`` and its schedulers), ``_step_log``
(Lightning's ``self.log``) and ``_model_parallel`` (TP and PP plans, the pipeline's stages);
the worker's, ``_step`` (one optimiser step: precision, the loss or the model's
``training_step``, the scaler), ``_strategy`` (DDP, FSDP2, TP, PP wrapping), ``_collectives``
(the epoch's reductions across workers), ``_evaluation`` (the validation pass), ``_commit``
(snapshots, the background committer, the checkpoint budget, retention),
``_distributed_checkpoint`` (DCP's files, gathered or sharded), ``_resume`` (restoring a
checkpoint, mid-epoch resume points, how a run ended, a trained model), ``_trainer``
(:class:`EpochTrainer`, one worker's epochs), ``_loop`` (:func:`train_epochs`, a worker
group's) and ``_test_scoring`` (the trained model scoring a streamed test split on Ray Data
actors); the driver's, ``_ray_training`` (Ray Train's TorchTrainer: scaling, run config,
:func:`fit`) and ``_train_failures`` (a worker's failure, deterministic or not, and
fail-fast).

Names load on first use (as ``prefect_ml``'s own do): the worker's modules import torch and
the launcher Ray Train, and the flows, the user contracts and the driver's checks import this
package without paying for either until they use them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prefect_ml.integrations.libraries import lazy_exports

# Public name -> the private module that defines it.
_EXPORTS = {
    "Probe": "_hooks",
    "check_contract": "_hooks",
    "check_loss": "_hooks",
    "checked_metrics": "_hooks",
    "defines": "_hooks",
    "is_hooked": "_hooks",
    "loss_function": "_hooks",
    "metrics_function": "_hooks",
    "probe_steps": "_hooks",
    "served_module": "_hooks",
    "test_step_metrics": "_hooks",
    "make_optimizer": "_optimization",
    "StepLog": "_step_log",
    "combine": "_step_log",
    "metric_name": "_step_log",
    "SIZE_FIELDS": "_model_parallel",
    "MeshLayout": "_model_parallel",
    "balanced_stages": "_model_parallel",
    "check_precision": "_model_parallel",
    "check_split": "_model_parallel",
    "sequential_plan": "_model_parallel",
    "stage_module": "_model_parallel",
    "tensor_parallel_plan": "_model_parallel",
    "precision_context": "_step",
    "all_reduce": "_collectives",
    "any_worker": "_collectives",
    "served_device_types": "_collectives",
    "METRICS_FILE": "_commit",
    "TRAINER_STATE_FILE": "_commit",
    "CheckpointBudget": "_commit",
    "CommitCost": "_commit",
    "EpochCommitter": "_commit",
    "Snapshot": "_commit",
    "StagedSnapshot": "_commit",
    "best_tracker": "_commit",
    "retention": "_commit",
    "ShardedSnapshot": "_distributed_checkpoint",
    "checkpoint_group": "_distributed_checkpoint",
    "commit_sharded": "_distributed_checkpoint",
    "load_files": "_distributed_checkpoint",
    "resolve_layout": "_distributed_checkpoint",
    "shard_files": "_distributed_checkpoint",
    "to_files": "_distributed_checkpoint",
    "ResumePoint": "_resume",
    "TrainingEnd": "_resume",
    "committed_history": "_resume",
    "load_trained_model": "_resume",
    "training_end": "_resume",
    "EpochOutcome": "_trainer",
    "EpochTrainer": "_trainer",
    "train_epochs": "_loop",
    "score_split": "_test_scoring",
    "PEAK_MEMORY_TAG": "_ray_training",
    "STARTED_AT_TAG": "_ray_training",
    "WORKER_GROUP_READY_TAG": "_ray_training",
    "WORKER_GROUP_TAGS": "_ray_training",
    "WORKER_NODES_TAG": "_ray_training",
    "WORLD_SIZE_TAG": "_ray_training",
    "fit": "_ray_training",
    "loop_config": "_ray_training",
    "scaling_config": "_ray_training",
    "train_loop_per_worker": "_ray_training",
    "FailFast": "_train_failures",
    "WorkerFailure": "_train_failures",
    "code_failure_message": "_train_failures",
    "deterministic": "_train_failures",
    "innermost_frame": "_train_failures",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # for type checkers and editors; at run time __getattr__ loads them
    from prefect_ml.integrations.training._collectives import all_reduce as all_reduce
    from prefect_ml.integrations.training._collectives import any_worker as any_worker
    from prefect_ml.integrations.training._collectives import (
        served_device_types as served_device_types,
    )
    from prefect_ml.integrations.training._commit import METRICS_FILE as METRICS_FILE
    from prefect_ml.integrations.training._commit import TRAINER_STATE_FILE as TRAINER_STATE_FILE
    from prefect_ml.integrations.training._commit import CheckpointBudget as CheckpointBudget
    from prefect_ml.integrations.training._commit import CommitCost as CommitCost
    from prefect_ml.integrations.training._commit import EpochCommitter as EpochCommitter
    from prefect_ml.integrations.training._commit import Snapshot as Snapshot
    from prefect_ml.integrations.training._commit import StagedSnapshot as StagedSnapshot
    from prefect_ml.integrations.training._commit import best_tracker as best_tracker
    from prefect_ml.integrations.training._commit import retention as retention
    from prefect_ml.integrations.training._distributed_checkpoint import (
        ShardedSnapshot as ShardedSnapshot,
    )
    from prefect_ml.integrations.training._distributed_checkpoint import (
        checkpoint_group as checkpoint_group,
    )
    from prefect_ml.integrations.training._distributed_checkpoint import (
        commit_sharded as commit_sharded,
    )
    from prefect_ml.integrations.training._distributed_checkpoint import load_files as load_files
    from prefect_ml.integrations.training._distributed_checkpoint import (
        resolve_layout as resolve_layout,
    )
    from prefect_ml.integrations.training._distributed_checkpoint import shard_files as shard_files
    from prefect_ml.integrations.training._distributed_checkpoint import to_files as to_files
    from prefect_ml.integrations.training._hooks import Probe as Probe
    from prefect_ml.integrations.training._hooks import check_contract as check_contract
    from prefect_ml.integrations.training._hooks import check_loss as check_loss
    from prefect_ml.integrations.training._hooks import checked_metrics as checked_metrics
    from prefect_ml.integrations.training._hooks import defines as defines
    from prefect_ml.integrations.training._hooks import is_hooked as is_hooked
    from prefect_ml.integrations.training._hooks import loss_function as loss_function
    from prefect_ml.integrations.training._hooks import metrics_function as metrics_function
    from prefect_ml.integrations.training._hooks import probe_steps as probe_steps
    from prefect_ml.integrations.training._hooks import served_module as served_module
    from prefect_ml.integrations.training._hooks import test_step_metrics as test_step_metrics
    from prefect_ml.integrations.training._loop import train_epochs as train_epochs
    from prefect_ml.integrations.training._model_parallel import SIZE_FIELDS as SIZE_FIELDS
    from prefect_ml.integrations.training._model_parallel import MeshLayout as MeshLayout
    from prefect_ml.integrations.training._model_parallel import balanced_stages as balanced_stages
    from prefect_ml.integrations.training._model_parallel import check_precision as check_precision
    from prefect_ml.integrations.training._model_parallel import check_split as check_split
    from prefect_ml.integrations.training._model_parallel import sequential_plan as sequential_plan
    from prefect_ml.integrations.training._model_parallel import stage_module as stage_module
    from prefect_ml.integrations.training._model_parallel import (
        tensor_parallel_plan as tensor_parallel_plan,
    )
    from prefect_ml.integrations.training._optimization import make_optimizer as make_optimizer
    from prefect_ml.integrations.training._ray_training import PEAK_MEMORY_TAG as PEAK_MEMORY_TAG
    from prefect_ml.integrations.training._ray_training import STARTED_AT_TAG as STARTED_AT_TAG
    from prefect_ml.integrations.training._ray_training import (
        WORKER_GROUP_READY_TAG as WORKER_GROUP_READY_TAG,
    )
    from prefect_ml.integrations.training._ray_training import (
        WORKER_GROUP_TAGS as WORKER_GROUP_TAGS,
    )
    from prefect_ml.integrations.training._ray_training import WORKER_NODES_TAG as WORKER_NODES_TAG
    from prefect_ml.integrations.training._ray_training import WORLD_SIZE_TAG as WORLD_SIZE_TAG
    from prefect_ml.integrations.training._ray_training import fit as fit
    from prefect_ml.integrations.training._ray_training import loop_config as loop_config
    from prefect_ml.integrations.training._ray_training import scaling_config as scaling_config
    from prefect_ml.integrations.training._ray_training import (
        train_loop_per_worker as train_loop_per_worker,
    )
    from prefect_ml.integrations.training._resume import ResumePoint as ResumePoint
    from prefect_ml.integrations.training._resume import TrainingEnd as TrainingEnd
    from prefect_ml.integrations.training._resume import committed_history as committed_history
    from prefect_ml.integrations.training._resume import load_trained_model as load_trained_model
    from prefect_ml.integrations.training._resume import training_end as training_end
    from prefect_ml.integrations.training._step import precision_context as precision_context
    from prefect_ml.integrations.training._step_log import StepLog as StepLog
    from prefect_ml.integrations.training._step_log import combine as combine
    from prefect_ml.integrations.training._step_log import metric_name as metric_name
    from prefect_ml.integrations.training._test_scoring import score_split as score_split
    from prefect_ml.integrations.training._train_failures import FailFast as FailFast
    from prefect_ml.integrations.training._train_failures import WorkerFailure as WorkerFailure
    from prefect_ml.integrations.training._train_failures import (
        code_failure_message as code_failure_message,
    )
    from prefect_ml.integrations.training._train_failures import deterministic as deterministic
    from prefect_ml.integrations.training._train_failures import innermost_frame as innermost_frame
    from prefect_ml.integrations.training._trainer import EpochOutcome as EpochOutcome
    from prefect_ml.integrations.training._trainer import EpochTrainer as EpochTrainer


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
