"""A campaign's identity: its name in one Optuna storage, whatever credentials reach it."""

from __future__ import annotations

from prefect_ml.tasks.campaign.identity import CampaignIdentity


def test_the_same_database_with_other_credentials_is_the_same_campaign() -> None:
    before = CampaignIdentity.of("c", "postgresql://ml:old@db:5432/optuna", "s3://bucket/ml")
    rotated = CampaignIdentity.of("c", "postgresql://ml2:new@db:5432/optuna", "s3://bucket/ml")
    assert rotated == before
    assert "old" not in before.key and "old" not in before.checkpoint_root


def test_the_same_name_in_two_storages_is_two_campaigns_sharing_no_folder() -> None:
    one = CampaignIdentity.of("c", "postgresql://db:5432/optuna", "s3://bucket/ml")
    other = CampaignIdentity.of("c", "sqlite:////home/a/optuna.db", "s3://bucket/ml")
    assert one.key != other.key
    assert one.checkpoint_root != other.checkpoint_root
    assert one.lease_url.startswith(one.checkpoint_root)
    assert one.trial_url(3).endswith("/trial-00003")


def test_a_tenant_s_campaign_is_its_own_study_and_key() -> None:
    mine = CampaignIdentity.of("c", "sqlite:////o.db", "s3://b/ml/tenants/acme", tenant="acme")
    theirs = CampaignIdentity.of("c", "sqlite:////o.db", "s3://b/ml/tenants/beta", tenant="beta")
    assert (mine.name, theirs.name) == ("acme.c", "beta.c")
    assert mine.key != theirs.key
    assert mine.checkpoint_root.startswith("s3://b/ml/tenants/acme/campaigns/")
