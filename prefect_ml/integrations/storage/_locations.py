"""Where runs may read and write: the data URL schemes and hosts allowed, and the places under
the storage root (a tenant's folder, ``PREFECT_ML_DATA_PREFIXES``) a URL must lie in."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

from prefect_ml.integrations import tenancy
from prefect_ml.integrations.errors import ConfigurationError
from prefect_ml.integrations.settings import get_settings
from prefect_ml.integrations.storage._keys import check_url, join
from prefect_ml.integrations.storage._layout import root_url

# Where a dataset may be read from by default: local files and object stores. Other fsspec
# protocols reach other machines on the driver's behalf (http, ftp, sftp, github...): a URL
# parameter from the UI would make the driver fetch from wherever it points (internal services,
# cloud metadata endpoints); they are allowed only through PREFECT_ML_EXTRA_URL_SCHEMES.
DATA_URL_SCHEMES = frozenset(
    {"file", "local", "s3", "s3a", "gs", "gcs", "abfs", "abfss", "az", "memory"}
)


# A scheme without "//" (``data:text/csv,...``, which fsspec opens as inline data); a single
# letter is a Windows drive, not a scheme.
_OPAQUE_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):(?!//)")


def _scheme_and_host(part: str, chained: bool) -> tuple[str, str]:
    scheme, separator, rest = part.partition("://")
    if not separator:  # a local path, a data: URL, or a protocol name inside a chain
        opaque = _OPAQUE_SCHEME.match(part)
        return (opaque[1] if opaque else part if chained else "file").lower(), ""
    return scheme.lower(), rest.split("/", 1)[0].rsplit("@", 1)[-1]


def _check_host(url: str, host: str, field: str) -> None:
    """Refuse a network URL unless its host resolves, and only to public addresses: never
    loopback, private, link-local (cloud metadata) or reserved ones, by name or by number."""
    import ipaddress
    import socket
    from urllib.parse import urlsplit

    try:
        name = urlsplit(f"//{host}").hostname or ""
        literal = {str(ipaddress.ip_address(name))} if _is_ip(name) else set()
        addresses = literal or {str(info[4][0]) for info in socket.getaddrinfo(name, None)}
    except (OSError, UnicodeError, ValueError):
        raise ConfigurationError(
            field, f"the host of {url!r} does not resolve; refused (give a public address)"
        ) from None
    internal = sorted(a for a in addresses if not ipaddress.ip_address(a.split("%")[0]).is_global)
    if internal:
        raise ConfigurationError(
            field,
            f"{url!r} reaches {', '.join(internal)}: loopback, private, link-local (cloud "
            "metadata) or reserved addresses are refused for data",
        )


def _is_ip(name: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def check_data_url(url: str, field: str) -> str:
    """A data URL whose every scheme (``a::b://`` chains included) is allowed, whose network
    hosts resolve to public addresses only, in the places runs may use
    (:func:`check_locations`), without traversal segments."""
    allowed = DATA_URL_SCHEMES | set(get_settings().allowed_extra_url_schemes)
    parts = url.split("::")
    for part in parts:
        scheme, host = _scheme_and_host(part, chained=len(parts) > 1)
        if scheme not in allowed:
            raise ConfigurationError(
                field,
                f"URL scheme {scheme!r} of {url!r} is not allowed for data; use one of "
                f"{sorted(allowed)}, or add it to PREFECT_ML_EXTRA_URL_SCHEMES if the flow may "
                "fetch data from such addresses",
            )
        # The last URL of a chain is where the bytes come from; the others name paths inside
        # it (zip://member) or wrap it (simplecache).
        if scheme not in DATA_URL_SCHEMES and host and part is parts[-1]:
            _check_host(url, host, field)
    check_locations([url], field)
    return check_url(url, field)


# fsspec's aliases of one store: the same objects under two schemes compare equal.
_SCHEME_ALIASES = {"s3a": "s3", "gcs": "gs", "abfss": "abfs", "local": "file"}
_LOCAL_PREFIX = re.compile(r"^(?:file|local):")


def canonical_location(url: str) -> str:
    """Where ``url`` points, comparable by prefix: the last URL of an fsspec chain, a local
    path with its symlinks and ``..`` resolved (``realpath``), a lower-case scheme."""
    last = url.split("::")[-1]
    scheme, separator, rest = last.partition("://")
    if not separator:  # a path; fsspec opens ``file:<path>`` and ``local:<path>`` as the path
        scheme, rest = "file", _LOCAL_PREFIX.sub("", last)
    scheme = _SCHEME_ALIASES.get(scheme.lower(), scheme.lower())
    if scheme == "file":  # fsspec expands a leading ``~`` to a home folder, as expanduser does
        return "file://" + os.path.realpath(os.path.expanduser(rest))
    return f"{scheme}://{rest}"


def is_within(url: str, root: str) -> bool:
    """Whether ``url`` is ``root`` or lies under it (whole path segments, symlinks resolved)."""
    location, base = canonical_location(url), canonical_location(root).rstrip("/")
    return location == base or location.startswith(base + "/")


def check_locations(urls: Sequence[str], field: str) -> None:
    """Raise, naming ``field``, unless runs may read or write at every URL of ``urls``: under
    the storage root (the tenant's folder with a tenant) or a prefix of PREFECT_ML_DATA_PREFIXES
    when either is set; never under a tenant's folder that is not this process's tenant's."""
    settings = get_settings()
    own = root_url(settings)
    roots = (own, *settings.allowed_data_prefixes)
    confined = settings.tenant is not None or bool(settings.allowed_data_prefixes)
    tenants = join(settings.resolved_storage_url, tenancy.STORAGE_FOLDER)
    for url in urls:
        if confined and not any(is_within(url, root) for root in roots):
            raise ConfigurationError(
                field,
                f"{url!r} is outside the places runs may use ({', '.join(roots)}); move the "
                "data there, or ask the operator to add its prefix to PREFECT_ML_DATA_PREFIXES",
            )
        if is_within(url, tenants) and not (settings.tenant and is_within(url, own)):
            raise ConfigurationError(field, f"{url!r} is in a tenant's folder that is not yours")
