"""The storage layout: every root under the storage URL is named here, and nowhere else."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prefect_ml.integrations import tenancy
from prefect_ml.integrations.storage._keys import join

if TYPE_CHECKING:
    from prefect_ml.integrations.settings import PrefectMLSettings


def root_url(settings: PrefectMLSettings) -> str:
    """The root of everything runs store (splits, checkpoints, leases, campaigns): the storage
    URL, or its ``tenants/<tenant>`` folder when a tenant is set."""
    return join(settings.resolved_storage_url, *tenancy.storage_keys(settings.tenant))


def dataset_url(root_url: str, fingerprint: str) -> str:
    """The prepared splits of the dataset (and recipe) with ``fingerprint``."""
    return join(root_url, "datasets", fingerprint)


def split_array_url(splits_url: str, split: str, part: str) -> str:
    """An in-memory split's ``features`` or ``labels`` array (``.npy``)."""
    return join(splits_url, f"{split}_{part}.npy")


def statistic_url(splits_url: str, name: str) -> str:
    """The training split's per-feature ``mean`` or ``std`` (``.npy``), both layouts."""
    return join(splits_url, f"{name}.npy")


def split_parquet_url(splits_url: str) -> str:
    """A streamed dataset's Parquet shards, one ``split=<name>`` folder per split."""
    return join(splits_url, "parquet")


def shard_manifest_url(splits_url: str) -> str:
    """A streamed dataset's shard manifest: every split's files and their row counts."""
    return join(splits_url, "shards.json")


def dataset_meta_url(splits_url: str) -> str:
    """What was prepared (JSON), written after every split: its presence means complete."""
    return join(splits_url, "meta.json")


def run_checkpoint_url(root_url: str, experiment_id: str, run_id: str) -> str:
    """The checkpoints of one training run."""
    return join(root_url, "checkpoints", experiment_id, run_id)


def campaign_url(root_url: str, storage_digest: str, name: str) -> str:
    """A campaign's root: its trials' checkpoints and its lease."""
    return join(root_url, "campaigns", storage_digest, name)


def trial_checkpoint_url(campaign_url: str, root_trial: int) -> str:
    """The checkpoints of a campaign trial and of its retries (they share the first's number)."""
    return join(campaign_url, f"trial-{root_trial:05d}")


def trial_stop_url(trial_checkpoint_url: str, attempt: int) -> str:
    """The marker that asks one attempt of a trial to stop after its current epoch."""
    return join(trial_checkpoint_url, f"STOP-{attempt}")


def lease_url(root_url: str) -> str:
    """The lease folder of whatever lives under ``root_url`` (a campaign's checkpoint root)."""
    return join(root_url, "lease")


def training_lease_url(storage_url: str, run_key: str) -> str:
    """The lease folder of the training run with identity ``run_key``; it exists before the
    run's MLflow id (and so its checkpoint folder) is known."""
    return join(storage_url, "leases", "training", run_key)


def predictions_url(root_url: str, fingerprint: str) -> str:
    """A batch scoring's Parquet output for the input files and model version with
    ``fingerprint``."""
    return join(root_url, "predictions", fingerprint)


def predictions_manifest_url(output_url: str) -> str:
    """What a batch scoring wrote (JSON), written after every Parquet file: its presence
    means complete. ``_``-prefixed, so a reader of the folder's data files skips it."""
    return join(output_url, "_SUCCESS")


def predictions_pending_url(output_url: str) -> str:
    """The marker a batch scoring writes before its first file: the folder is ours to clear
    when no manifest follows (a crashed write)."""
    return join(output_url, "_PENDING")


def doctor_url(root_url: str, name: str) -> str:
    """Where ``prefect-ml doctor`` puts its probe objects under ``root_url``: ``.doctor/<name>``,
    one name per node (its Ray node id) and per driver, so a leftover says who wrote it."""
    return join(root_url, ".doctor", name)
