"""Tenants: the one rule that puts every name a run leaves behind into its tenant's namespace.

With ``PREFECT_ML_TENANT=acme`` the MLflow experiments and registered models are
``acme.<name>`` (so ``@champion`` is per tenant), the Optuna studies ``acme.<name>``, the
storage (splits, checkpoints, leases, campaigns) lives under ``<storage>/tenants/acme/``, and
the tasks that occupy Ray carry the tag ``tenant:acme``, on which a Prefect concurrency limit
is the tenant's quota. Without a tenant every name is left as it is (the single-user layout).

A tenant name cannot contain the separator, so ``<tenant>.`` always ends at the tenant: no
name of one tenant is a name of another.
"""

from __future__ import annotations

import re

from prefect_ml.integrations.errors import ConfigurationError

SETTING = "PREFECT_ML_TENANT"
SEPARATOR = "."
TAG_PREFIX = "tenant:"
STORAGE_FOLDER = "tenants"
_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,39}")


def check_tenant(name: str) -> str:
    """``name`` if it is a valid tenant: lower-case letters, digits, '-' and '_', at most 40,
    starting with a letter or digit (no dots, slashes or path segments)."""
    if not _NAME.fullmatch(name):
        raise ConfigurationError(
            SETTING,
            f"{name!r} is not a tenant name: use 1-40 lower-case letters, digits, '-' or '_', "
            "starting with a letter or digit",
        )
    return name


def qualify(name: str, tenant: str | None) -> str:
    """``name`` in ``tenant``'s namespace (``<tenant>.<name>``); as it is without a tenant.

    A name already in the namespace is returned unchanged, so qualifying twice is harmless
    (a registered version's own name can be passed back).
    """
    if tenant is None or name.startswith(f"{tenant}{SEPARATOR}"):
        return name
    return f"{tenant}{SEPARATOR}{name}"


def owns(qualified_name: str, tenant: str | None) -> bool:
    """Whether ``qualified_name`` is in ``tenant``'s namespace (everything is, without one)."""
    return tenant is None or qualified_name.startswith(f"{tenant}{SEPARATOR}")


def storage_keys(tenant: str | None) -> tuple[str, ...]:
    """The key segments that put storage under the tenant (``tenants/<tenant>``); none without."""
    return () if tenant is None else (STORAGE_FOLDER, tenant)


def tag(tenant: str) -> str:
    """The Prefect tag of the tenant's Ray-occupying tasks; its concurrency limit is the quota."""
    return f"{TAG_PREFIX}{tenant}"
