"""Training on one worker and a worker group: the per-worker loop that Ray Train workers
(:mod:`integrations.ray_training`), campaign trials in one warm process and the GPU check run,
and what the driver reads back from its checkpoints. Only torch and numpy.

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
``distributed_checkpoint.resolve_layout``): *gathered* (DDP, one process), where rank 0
gathers the full state and commits it, or *sharded* (FSDP, TP, PP by default), where every
rank writes its own shards and rank 0 commits the manifest that names them all, so no host
ever holds the whole model. Loading goes through DCP into the current layout, so a checkpoint
written by 2 FSDP workers restores into 3 DDP workers, into one campaign trial, or into a
plain model for evaluation.

Behind this face: ``_step`` (one optimiser step: precision, the loss or the model's
``training_step``, the scaler), ``_strategy`` (DDP, FSDP2, TP, PP wrapping), ``_evaluation``
(the validation pass), ``_commit`` (snapshots, the background committer, the checkpoint
budget, retention), ``_resume`` (restoring a checkpoint, mid-epoch resume points, how a run
ended, a trained model), ``_trainer`` (:class:`EpochTrainer`, one worker's epochs) and
``_loop`` (:func:`train_epochs`, a worker group's).
"""

from prefect_ml.integrations.training._commit import (
    METRICS_FILE,
    TRAINER_STATE_FILE,
    CheckpointBudget,
    EpochCommitter,
    Snapshot,
    StagedSnapshot,
    best_tracker,
    retention,
)
from prefect_ml.integrations.training._loop import train_epochs
from prefect_ml.integrations.training._resume import (
    ResumePoint,
    TrainingEnd,
    committed_history,
    load_trained_model,
    training_end,
)
from prefect_ml.integrations.training._step import precision_context
from prefect_ml.integrations.training._trainer import EpochOutcome, EpochTrainer

__all__ = [
    "METRICS_FILE",
    "TRAINER_STATE_FILE",
    "CheckpointBudget",
    "EpochCommitter",
    "EpochOutcome",
    "EpochTrainer",
    "ResumePoint",
    "Snapshot",
    "StagedSnapshot",
    "TrainingEnd",
    "best_tracker",
    "committed_history",
    "load_trained_model",
    "precision_context",
    "retention",
    "train_epochs",
    "training_end",
]
