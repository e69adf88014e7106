"""What prefect-ml writes on MLflow's runs and model versions: every tag name is here, and
nowhere else, as the storage layout is in :mod:`integrations.storage`."""

# Runs and versions of a training.
RUN_KEY_TAG = "prefect_ml.run_key"
FLOW_RUN_TAG = "prefect.flow_run_id"
FINGERPRINT_TAG = "prefect_ml.dataset_fingerprint"
DATA_LAYOUT_TAG = "prefect_ml.data_layout"  # arrays (read whole) or parquet (streamed)
SOURCE_RUN_TAG = "prefect_ml.mlflow_run_id"
SAMPLE_SHAPE_TAG = "prefect_ml.sample_shape"  # JSON, on model versions: what serving validates
CLASS_NAMES_TAG = "prefect_ml.class_names"
FEATURE_NAMES_TAG = "prefect_ml.feature_names"
TASK_TAG = "prefect_ml.task"  # on model versions: classification or regression
INPUT_DTYPE_TAG = "prefect_ml.input_dtype"  # on model versions: float32 unless it says float64
BEST_EPOCH_TAG = "prefect_ml.best_epoch"  # on runs: the epoch evaluated and registered
EARLY_STOPPED_TAG = "prefect_ml.early_stopped"  # on runs: where early stopping ended training
REGISTERED_VERSION_TAG = "registered_version"  # on runs: the version registered from the run
FLOW_RUNS_TAG_PREFIX = "prefect_ml.flow_run."  # on runs: <flow run id>.<step> -> when
SPLITS_TAG = "prefect_ml.splits_url"  # on training runs: the prepared splits it trained on
DATASET_CONTEXT = "training"  # the mlflow.data.context of a training run's dataset input

# Serving, on model versions.
SERVING_TAG_PREFIX = "prefect_ml.serving."  # on versions, one per Serve application (JSON)
CANARY_TAG = "prefect_ml.canary"  # on versions: the verdict of its canary rollout

# Campaigns: one parent run per campaign, one nested run per trial.
PARENT_TAG = "mlflow.parentRunId"  # MLflow's own tag: the UI nests runs by it
CAMPAIGN_TAG = "prefect_ml.campaign"  # on trial runs
CAMPAIGN_PARENT_TAG = "prefect_ml.campaign_parent"  # on the campaign's parent run
TRIAL_TAG = "prefect_ml.trial_number"
TRIAL_STATE_TAG = "prefect_ml.trial_state"
ERROR_TAG = "prefect_ml.error"
WORKER_TAG = "prefect_ml.worker_pid"  # the process that trained a trial (warm workers are reused)
CODE_TAG = "prefect_ml.code"  # on a cluster: what the job shipped (prefect-ml, user modules)
NODE_TAG = "prefect_ml.worker_node"  # the address of the Ray node that trained a trial
RESUMED_TAG = "prefect_ml.resumed_from_epoch"  # a retried trial continued from this checkpoint
