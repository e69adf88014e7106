"""Bytes at a URL through fsspec: local disk, S3 through s3fs, anything fsspec opens.

Every step reads and writes through this package, so one place decides how an object store is
reached (endpoint, region, credentials, retries), how a write stays all-or-nothing, which keys
and URLs are refused, and where each thing lives under the storage root. S3 is configured the
standard AWS way: ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``, ``AWS_REGION`` /
``AWS_DEFAULT_REGION``, credentials from the environment, ``AWS_PROFILE`` or instance roles, or
a Prefect Secret block named by ``PREFECT_ML_S3_CREDENTIALS_BLOCK`` (see
:func:`apply_credentials_block`).

Behind this face: ``_files`` (bytes: reads, all-or-nothing writes, exclusive creation,
listings), ``_arrays`` (``.npy`` arrays), ``_keys`` (keys and base URLs that cannot leave their
prefix), ``_locations`` (which data URLs and places runs may use), ``_layout`` (the storage
layout), ``_access`` (credentials, the probe before any compute, Ray's view of the store),
``_checkpoints`` (a run's checkpoints as folders with a manifest: the manifest's sha256 and
signature, retention) and ``_leases`` (the single-holder lease of a run or a campaign, a record
under its storage root). Checkpoints and leases are stored things with their own layout and
their own atomicity; they read and write only through the modules beside them.
"""

from prefect_ml.integrations.storage._access import (
    CREDENTIAL_VARIABLES,
    abort_incomplete_uploads,
    apply_credentials_block,
    check_writable,
    prepare_storage,
    ray_storage,
)
from prefect_ml.integrations.storage._arrays import (
    array_rows,
    read_array,
    read_array_rows,
    write_array,
)
from prefect_ml.integrations.storage._checkpoints import (
    MANIFEST,
    SIGNATURE,
    CheckpointPosition,
    CheckpointStore,
    MetricsOnlyCheckpoint,
    RetentionPolicy,
    VerifiedCheckpoint,
    manifest_signature,
)
from prefect_ml.integrations.storage._files import (
    S3_CONCURRENCY,
    S3_PART_SIZE,
    create_exclusive,
    exists,
    filesystem,
    is_local,
    list_names,
    list_sizes,
    modified_time,
    open_file,
    read_all_and_sha256,
    read_bytes,
    read_bytes_and_sha256,
    remove,
    remove_folder,
    storage_clock,
    write_bytes,
)
from prefect_ml.integrations.storage._keys import check_key, check_url, join
from prefect_ml.integrations.storage._layout import (
    campaign_url,
    dataset_meta_url,
    dataset_url,
    doctor_url,
    lease_url,
    predictions_manifest_url,
    predictions_pending_url,
    predictions_url,
    root_url,
    run_checkpoint_url,
    shard_manifest_url,
    split_array_url,
    split_parquet_url,
    statistic_url,
    training_lease_url,
    trial_checkpoint_url,
    trial_stop_url,
)
from prefect_ml.integrations.storage._leases import (
    Heartbeat,
    Lease,
    LeaseHeldError,
    LeaseLostError,
    LeaseRecord,
    held_error,
)
from prefect_ml.integrations.storage._locations import (
    DATA_URL_SCHEMES,
    canonical_location,
    check_data_url,
    check_locations,
    is_within,
)

__all__ = [
    "CREDENTIAL_VARIABLES",
    "DATA_URL_SCHEMES",
    "MANIFEST",
    "S3_CONCURRENCY",
    "S3_PART_SIZE",
    "SIGNATURE",
    "CheckpointPosition",
    "CheckpointStore",
    "Heartbeat",
    "Lease",
    "LeaseHeldError",
    "LeaseLostError",
    "LeaseRecord",
    "MetricsOnlyCheckpoint",
    "RetentionPolicy",
    "VerifiedCheckpoint",
    "abort_incomplete_uploads",
    "apply_credentials_block",
    "array_rows",
    "campaign_url",
    "canonical_location",
    "check_data_url",
    "check_key",
    "check_locations",
    "check_url",
    "check_writable",
    "create_exclusive",
    "dataset_meta_url",
    "dataset_url",
    "doctor_url",
    "exists",
    "filesystem",
    "held_error",
    "is_local",
    "is_within",
    "join",
    "lease_url",
    "list_names",
    "list_sizes",
    "manifest_signature",
    "modified_time",
    "open_file",
    "predictions_manifest_url",
    "predictions_pending_url",
    "predictions_url",
    "prepare_storage",
    "ray_storage",
    "read_all_and_sha256",
    "read_array",
    "read_array_rows",
    "read_bytes",
    "read_bytes_and_sha256",
    "remove",
    "remove_folder",
    "root_url",
    "run_checkpoint_url",
    "shard_manifest_url",
    "split_array_url",
    "split_parquet_url",
    "statistic_url",
    "storage_clock",
    "training_lease_url",
    "trial_checkpoint_url",
    "trial_stop_url",
    "write_array",
    "write_bytes",
]
