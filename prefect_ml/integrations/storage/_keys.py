"""Keys joined under a storage prefix, and user-given base URLs, that cannot leave it."""

from __future__ import annotations

import re
from urllib.parse import unquote

from prefect_ml.integrations.errors import ConfigurationError

_ENCODED = re.compile(r"%[0-9A-Fa-f]{2}")


def check_key(part: str) -> str:
    """``part`` if it is a safe relative key; raise if it could leave the directory it joins.

    Refuses ``..`` segments however they are percent-encoded (``..%2f``, ``%252e%252e%252f``),
    absolute paths, URLs, fsspec chains (``::``), backslashes and NUL bytes.
    """
    decoded = part
    for _ in range(5):  # %25 → % → the character: decode until nothing changes
        if not _ENCODED.search(decoded):
            break
        decoded = unquote(decoded)
    else:
        raise ConfigurationError("key", f"{part!r} is percent-encoded too many times")
    problem = None
    if "\x00" in decoded or "\\" in decoded:
        problem = "contains a NUL byte or a backslash"
    elif "::" in decoded:  # fsspec reads it as a chain of URLs: another filesystem
        problem = "contains '::'"
    elif decoded.startswith("/") or "://" in decoded or re.match(r"^[A-Za-z]:", decoded):
        problem = "is absolute"
    elif any(segment in ("..", ".") for segment in decoded.split("/")):
        problem = "has a '..' or '.' segment"
    if problem:
        raise ConfigurationError("key", f"{part!r} {problem}; keys must stay inside their prefix")
    return part


def join(url: str, *parts: str) -> str:
    """``url`` with ``parts`` appended as path segments; every part must pass :func:`check_key`."""
    return "/".join([url.rstrip("/"), *(check_key(p).strip("/") for p in parts)])


def check_url(url: str, field: str) -> str:
    """A user-given base URL without traversal segments (``s3://b/a/../c`` is refused), in each
    URL of an fsspec chain (``zip://a.csv::s3://b/a.zip``)."""
    try:
        for part in url.split("::"):
            check_key(part.rpartition("://")[2].lstrip("/").rstrip("/"))
    except ConfigurationError as exc:
        raise ConfigurationError(field, exc.message) from None
    return url
