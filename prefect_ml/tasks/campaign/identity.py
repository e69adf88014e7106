"""One name for a campaign everywhere it leaves state: the study, MLflow and storage."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from prefect_ml.integrations import storage, tenancy


@dataclass(frozen=True)
class CampaignIdentity:
    """A campaign is its name *in one Optuna storage*: the same name in two storages is two
    campaigns, so the MLflow key and the checkpoint root both carry the storage's hash (two
    homes with the default storage sharing one bucket do not share ``campaigns/default``).
    A tenant's campaign is its study ``<tenant>.<name>``, and ``storage_url`` is the tenant's
    storage root (:func:`integrations.storage.root_url`), so tenants share neither."""

    name: str  # the Optuna study
    key: str  # the MLflow parent run's and trial runs' campaign tag
    checkpoint_root: str  # every trial's checkpoints, under trial-NNNNN/

    @classmethod
    def of(
        cls, name: str, optuna_storage: str, storage_url: str, *, tenant: str | None = None
    ) -> CampaignIdentity:
        digest = hashlib.sha256(_without_credentials(optuna_storage).encode()).hexdigest()[:8]
        study = tenancy.qualify(name, tenant)
        return cls(
            name=study,
            key=f"{study}@{digest}",
            checkpoint_root=storage.campaign_url(storage_url, digest, name),
        )

    @property
    def lease_url(self) -> str:
        """The folder of the lease that makes one process at a time run this campaign."""
        return storage.lease_url(self.checkpoint_root)

    def trial_url(self, root_trial: int) -> str:
        """The checkpoints of a trial and of its retries (they share the first's number)."""
        return storage.trial_checkpoint_url(self.checkpoint_root, root_trial)


def _without_credentials(url: str) -> str:
    """The database URL without user and password: a rotated password is the same campaign."""
    if "://" not in url:  # a journal file's path
        return url
    from sqlalchemy.engine import URL, make_url

    parsed = make_url(url)
    return URL.create(
        parsed.drivername,
        host=parsed.host,
        port=parsed.port,
        database=parsed.database,
        query=parsed.query,
    ).render_as_string()
