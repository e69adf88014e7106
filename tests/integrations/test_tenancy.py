"""The tenant rule: which names a tenant may have, and where its names and files go."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from prefect_ml.integrations import storage, tenancy
from prefect_ml.integrations.errors import ConfigurationError
from prefect_ml.integrations.settings import PrefectMLSettings


@pytest.mark.parametrize(
    "name", ["", "../beta", "a/b", "a.b", "Acme", "-acme", "acme ", "a\x00", "%2e%2e", "x" * 41]
)
def test_a_tenant_name_with_path_segments_or_separators_is_refused(name: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        tenancy.check_tenant(name)
    assert caught.value.field == "PREFECT_ML_TENANT"


def test_the_setting_is_checked_when_read(
    home: PrefectMLSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PREFECT_ML_TENANT", "../beta")
    with pytest.raises(ValidationError, match="PREFECT_ML_TENANT: '../beta' is not a tenant"):
        PrefectMLSettings()
    monkeypatch.setenv("PREFECT_ML_TENANT", "team-a_1")
    assert PrefectMLSettings().tenant == "team-a_1"


def test_names_are_qualified_once_and_only_with_a_tenant() -> None:
    assert tenancy.qualify("digits", None) == "digits"
    assert tenancy.qualify("digits", "acme") == "acme.digits"
    assert tenancy.qualify("acme.digits", "acme") == "acme.digits"
    assert tenancy.qualify("beta.digits", "acme") == "acme.beta.digits"
    assert tenancy.owns("acme.digits", "acme") and not tenancy.owns("beta.digits", "acme")
    assert tenancy.owns("beta.digits", None)
    assert tenancy.tag("acme") == "tenant:acme"


def test_storage_goes_under_the_tenants_folder_only_with_a_tenant(
    home: PrefectMLSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert storage.root_url(home) == home.resolved_storage_url
    monkeypatch.setenv("PREFECT_ML_TENANT", "acme")
    monkeypatch.setenv("PREFECT_ML_STORAGE_URL", "s3://bucket/ml")
    assert storage.root_url(PrefectMLSettings()) == "s3://bucket/ml/tenants/acme"


_NAMEISH = st.text(
    st.sampled_from("abcxyz019-_./\\%2eAZ\u0430\u0131\uff0e\u2024 \x00"), min_size=0, max_size=12
)


@settings(max_examples=500, deadline=None)
@given(tenant=_NAMEISH, other=_NAMEISH, name=_NAMEISH)
def test_an_accepted_tenant_is_one_plain_segment_and_owns_none_of_another_s_names(
    tenant: str, other: str, name: str
) -> None:
    """Whatever the setting holds (dots, slashes, encodings, look-alike letters such as the
    Cyrillic 'а' or the dotless 'ı'), an accepted tenant is one ASCII path segment, and a name
    qualified into it is never in another tenant's namespace."""
    try:
        tenancy.check_tenant(tenant)
        tenancy.check_tenant(other)
    except ConfigurationError:
        return
    assert tenant.isascii() and storage.check_key(tenant) == tenant and "." not in tenant
    qualified = tenancy.qualify(name, tenant)
    assert tenancy.owns(qualified, tenant)
    assert tenant == other or not tenancy.owns(qualified, other)
